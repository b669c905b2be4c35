"""A prefork pool process connects to the store as it starts, not at its first run's end
(worker/pool/connect_ahead.py): that first run used to hold its key and its pool slot
for the connection's handshake (6-7 ms: the two slowest hand-offs to another worker in
bench/handoff.py), and every process a ``--max-tasks-per-child`` pool forks later
paid it again.

Judged from outside: the pool processes' own TCP connections to the store's port (not
the ones a process forked after its parent connected inherits), before any of them ran
a task, and for the process forked to replace one that ran its
``--max-tasks-per-child``.
"""

from __future__ import annotations

from urllib.parse import urlparse

import psutil
import pytest

from tests.support.waiting import wait_until
from tests.support.workers import Workers

APP = "tests.apps.exclusive"


def _tcp_to(pid: int, port: int) -> set[tuple[str, int]]:
    """The local ends of process ``pid``'s TCP connections to ``port`` on this machine."""
    try:
        connections = psutil.Process(pid).net_connections(kind="tcp")
    except psutil.NoSuchProcess:
        return set()
    return {tuple(c.laddr) for c in connections if c.raddr and c.raddr.port == port}


def _connected(pid: int, parent: int, port: int) -> bool:
    """Whether pool process ``pid`` holds a connection to ``port`` of its own: not one of
    its parent's, which a process forked after the parent connected inherits."""
    return bool(_tcp_to(pid, port) - _tcp_to(parent, port))


def test_each_pool_process_is_connected_before_its_first_run(
    workers: Workers, store_url: str
) -> None:
    port = urlparse(store_url).port
    assert port is not None
    worker = workers.start(APP, concurrency=2)
    wait_until(
        lambda: (
            len(worker.pool_pids()) == 2
            and all(_connected(pid, worker.pid, port) for pid in worker.pool_pids())
        ),
        30,
        "both pool processes to connect to the store before any task ran",
    )


@pytest.mark.timeout(120)
def test_a_process_forked_after_max_tasks_per_child_connects_as_it_starts(
    workers: Workers, store_url: str
) -> None:
    from tests.apps.exclusive import ex_skip

    port = urlparse(store_url).port
    assert port is not None
    worker = workers.start(APP, concurrency=1, extra_args=["--max-tasks-per-child", "1"])
    wait_until(lambda: len(worker.pool_pids()) == 1, 30, "the pool process")
    first = worker.pool_pids()[0]
    assert ex_skip.delay("ahead", 0).get(timeout=30)
    wait_until(
        lambda: worker.pool_pids() not in ([], [first]),
        30,
        "the process that ran its one task to be replaced",
    )
    (second,) = worker.pool_pids()
    wait_until(lambda: _connected(second, worker.pid, port), 30, "the new process to connect, idle")


@pytest.mark.timeout(120)
def test_processes_autoscale_adds_connect_as_they_start(workers: Workers, store_url: str) -> None:
    """The processes ``--autoscale`` forks as work arrives run plain tasks here (no store
    call of their own): a connection of their own can only be the one made ahead."""
    from tests.apps.busy_pool import occupy

    port = urlparse(store_url).port
    assert port is not None
    worker = workers.start("tests.apps.busy_pool", concurrency=3, extra_args=["--autoscale=3,1"])
    wait_until(lambda: len(worker.pool_pids()) == 1, 30, "the one process autoscale starts with")
    for _ in range(3):
        occupy.delay(8)
    wait_until(lambda: len(worker.pool_pids()) == 3, 30, "the pool grown to three")
    wait_until(
        lambda: all(_connected(pid, worker.pid, port) for pid in worker.pool_pids()),
        30,
        "every process autoscale added to connect to the store",
    )
