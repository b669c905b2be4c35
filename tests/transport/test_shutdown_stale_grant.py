"""A job the worker let go of before its pool process accepted it does not run there
(found by issue 39's loaded runs of test_held_window.py).

A rate-limited request handed to a pool process that reads it late (the machine loaded;
here: the pool processes SIGSTOPped for 1.5 s) waits in that process for a fresh token
before it is accepted (worker/pool/rate_grant.py). If the worker's warm shutdown begins
meanwhile, or its broker connection is lost, Celery drops the jobs its processes have
not accepted (``AsynPool.flush``: "they will be redelivered by the broker") and never
acknowledges them. A process that accepted such a job after its wait ran the body, and
the message came back: the call ran a second time on the next worker. Seen on RabbitMQ
(quorum queue), 4 of 4 tries before the fix: the run started 0.46-0.97 s after SIGTERM,
and its message was back in the queue, redelivered. Fixed in worker/pool/prefork.py
(``LetGo``): the process leaves such a job to the broker.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psutil
import pytest
from celery import Celery
from kombu import Queue

from tests.support.celery_processes import WorkerProcess
from tests.support.observer import Observer
from tests.support.waiting import wait_until
from tests.support.workers import Workers
from tests.transport.test_held_window import queued_ids

APP = "tests.apps.held_window"
CALLS = 40


@contextmanager
def _a_worker_judging_a_stale_grant(
    workers: Workers, observer: Observer, rabbitmq_url: str, queue: str
) -> Iterator[tuple[WorkerProcess, set[str]]]:
    """A worker of ``CALLS`` paced calls (2/s) whose pool process is waiting for a fresh
    token for a grant it read late; yields it with the sent task ids."""
    from tests.apps import held_window

    env = {"TEST_BROKER_URL": rabbitmq_url, "HELD_QUEUE": queue, "HELD_QUEUE_TYPE": "quorum"}
    publisher = Celery("publisher", broker=rabbitmq_url, set_as_current=False)
    arguments = held_window.queue_arguments("quorum", single_active=False)
    publisher.conf.task_queues = [Queue(queue, queue_arguments=arguments)]
    try:
        worker = workers.start(APP, concurrency=2, env=env)
        with publisher.producer_or_acquire() as producer:
            sent = {
                publisher.send_task(
                    held_window.paced.name, args=(n,), queue=queue, producer=producer
                ).id
                for n in range(CALLS)
            }
        observer.starts_of("paced", 2, timeout=30)
        children = worker.pool_pids()
        for pid in children:  # a loaded machine: the pool reads its jobs late
            os.kill(pid, signal.SIGSTOP)
        time.sleep(1.5)
        for pid in children:
            os.kill(pid, signal.SIGCONT)
        wait_until(
            lambda: "taking a fresh one before it is accepted" in worker.log_text(),
            10,
            "a pool process judging its rate grant late",
        )
        yield worker, sent
    finally:
        workers.stop_all(timeout=10)
        publisher.close()


def test_a_stale_grant_started_during_warm_shutdown_does_not_come_back(
    workers: Workers, observer: Observer, rabbitmq_url: str, queue: str
) -> None:
    with _a_worker_judging_a_stale_grant(workers, observer, rabbitmq_url, queue) as (
        worker,
        sent,
    ):
        stopped_at = observer.now_us()
        worker.stop(timeout=30)
        paced = [e for e in observer.started() if e["key"] == "paced"]
        queued = queued_ids(rabbitmq_url, queue)
        assert {e["task_id"] for e in paced} | queued == sent  # nothing lost
        twice = [
            (e["task_id"], round((e["start"] - stopped_at) / 1e6, 2))
            for e in paced
            if e["task_id"] in queued
        ]
        assert not twice, f"ran (s after SIGTERM) and back in the queue: {twice}"


def _close_broker_connections(pid: int) -> int:
    """Close, on the RabbitMQ side, every connection of process ``pid`` to it (as a
    network cut or a broker restart would); how many."""
    ports = {
        c.laddr.port
        for c in psutil.Process(pid).net_connections(kind="tcp")
        if c.raddr and c.raddr.port == 5672 and c.status == psutil.CONN_ESTABLISHED
    }
    listed = subprocess.run(
        ["rabbitmqctl", "-q", "list_connections", "peer_port", "pid"],
        check=True,
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    closed = 0
    for line in listed.splitlines():
        port, _, connection = line.partition("\t")
        if port.strip().isdigit() and int(port) in ports:
            done = subprocess.run(
                ["rabbitmqctl", "close_connection", connection.strip(), "test"],
                capture_output=True,
                timeout=30,
            )
            closed += done.returncode == 0
    return closed


def test_a_stale_grant_waiting_across_a_lost_connection_runs_once(
    workers: Workers, observer: Observer, rabbitmq_url: str, queue: str
) -> None:
    """The broker connection is lost while a pool process waits for its fresh token: the
    message comes back (to this worker, once it reconnects) and every call runs once."""
    try:
        subprocess.run(["rabbitmqctl", "status"], check=True, capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        pytest.skip("rabbitmqctl (to close a worker's connection) is not usable here")
    with _a_worker_judging_a_stale_grant(workers, observer, rabbitmq_url, queue) as (
        worker,
        sent,
    ):
        assert _close_broker_connections(worker.pid) >= 1
        wait_until(
            lambda: len({e["task_id"] for e in observer.started() if e["key"] == "paced"}) >= CALLS,
            60,
            "every call started after the reconnect",
        )
        time.sleep(1.0)  # a second start of one would come now
        starts: dict[str, int] = {}
        for e in observer.started():
            if e["key"] == "paced":
                starts[e["task_id"]] = starts.get(e["task_id"], 0) + 1
        assert set(starts) == sent
        twice = sorted(task_id for task_id, n in starts.items() if n > 1)
        assert not twice, f"started twice: {twice}"
        assert "Connection to broker lost" in worker.log_text()
