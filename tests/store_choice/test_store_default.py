"""Where the store is when no URL names it (issue 24, section 3): never per host without a
word when the broker is shared by several machines.

Each "machine" is a :class:`Machine` (own ``XDG_RUNTIME_DIR``, ``TMPDIR``, working
directory; no ``$BATON_URL``): the processes of two machines share only the broker URL.

* A Redis broker: its Redis is the store, so the machines coordinate. Before, each
  machine started an embedded store of its own and both ran one key at once.
* A broker that is not Redis and not on this machine (RabbitMQ, named by this
  machine's host name, as a second machine names it): every
  process refuses to start, in one line naming ``baton_url``. Before, each machine
  coordinated on its own embedded store, saying only a WARNING.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.celery_processes import _process_env
from tests.support.machine import Machine
from tests.support.observer import Observer, assert_no_overlap
from tests.support.processes import REPO_ROOT
from tests.support.servers import STORE_EPOCH, StoreServer
from tests.support.waiting import wait_until
from tests.support.workers import Workers

APP = "tests.apps.no_store_url"


def _resolves_to_loopback(host: str) -> bool:
    try:
        infos = socket.getaddrinfo(host, 5672, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    return all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


@pytest.fixture
def machines() -> Iterator[list[Machine]]:
    """Two machines under short paths (a unix socket path has ~107 bytes)."""
    roots = [Path(tempfile.mkdtemp(prefix="bm", dir="/tmp")) for _ in range(2)]
    both = [Machine(root) for root in roots]
    yield both
    for machine in both:
        machine.stop_embedded_servers()
    for root in roots:
        shutil.rmtree(root, ignore_errors=True)


def _env(machine: Machine, **extra: str) -> dict[str, str]:
    """The machine's environment for Workers: no store URL at all (``""`` unsets)."""
    return {**machine.env, "BATON_URL": "", "BATON_RUNTIME_DIR": "", **extra}


@pytest.mark.timeout(180)
def test_two_machines_with_a_redis_broker_and_no_store_url_coordinate(
    workers: Workers, observer: Observer, broker_server: StoreServer, machines: list[Machine]
) -> None:
    from tests.apps.no_store_url import ex_wait

    with broker_server.client() as broker:
        broker.delete(STORE_EPOCH)  # not a store declared new: as a deployed broker is
    pair = [
        workers.start(APP, env=_env(m), cwd=m.cwd, queues=f"m{n}", concurrency=2, wait=False)
        for n, m in enumerate(machines)
    ]
    for worker in pair:
        worker.wait_ready()
    # One key, sent to both machines' queues: each machine must wait for the other's run.
    for n in range(8):
        ex_wait.apply_async(("shared", 0.5), queue=f"m{n % 2}")

    runs = observer.wait_for(8, timeout=120)
    embedded = [m.embedded_servers() for m in machines]
    status = _status(machines[1])

    assert_no_overlap(runs)
    assert observer.max_running("shared") == 1
    pids = {r.pid for r in runs}
    assert all(pids & set(w.pool_pids()) for w in pair), "both machines ran the key"
    assert embedded == [[], []], "a machine started an embedded store"
    for worker in pair:
        log = worker.log_text()
        assert f"the broker's Redis ({broker_server.url(0)})" in log, log[-3000:]
        assert "embedded store" not in log
    assert status.returncode == 0, status.stderr
    assert f"store:    {broker_server.url(0)} (the broker's Redis" in status.stdout


def _status(machine: Machine, **extra: str) -> subprocess.CompletedProcess[str]:
    """``celery -A <app> baton status`` run on ``machine``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATON_")}
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", APP, "baton", "status"],
        env=_process_env({**env, **machine.env, **extra}),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _refused(log: str) -> list[str]:
    return [line for line in log.splitlines() if "ConfigError" in line and "baton_url" in line]


@pytest.mark.timeout(120)
def test_a_remote_broker_that_is_not_redis_and_no_store_url_is_refused(
    workers: Workers, rabbitmq_url: str, machines: list[Machine]
) -> None:
    # Another machine by name: this machine's host name, which celery-baton judges from
    # the URL alone (no look-up), while the name resolves to loopback here, so the
    # workers reach the local RabbitMQ and no traffic leaves the loopback interface.
    host = socket.gethostname()
    if not _resolves_to_loopback(host):
        pytest.skip(f"the host name {host!r} does not resolve to a loopback address here")
    remote = f"amqp://guest:guest@{host}:5672//"
    started = [
        workers.start(APP, env=_env(m, TEST_BROKER_URL=remote), cwd=m.cwd, wait=False)
        for m in machines
    ]
    beat = workers.start_beat(
        APP,
        env=_env(machines[0], TEST_BROKER_URL=remote),
        cwd=machines[0].cwd,
        scheduler="celery_baton.beat:Scheduler",
        wait=False,
    )
    for process in [*started, beat]:
        wait_until(lambda p=process: not p.is_running, 60, f"{process!r} refused to start")
    status = _status(machines[1], TEST_BROKER_URL=remote)
    embedded = [m.embedded_servers() for m in machines]

    for process in [*started, beat]:
        assert process.returncode != 0
        lines = _refused(process.log_text())
        assert lines, process.log_tail()
        assert f"{host}:5672" in lines[-1] and "embedded://" in lines[-1]
    assert embedded == [[], []], "a machine started an embedded store"
    assert status.returncode != 0 and "baton_url" in status.stderr, status.stderr
    assert "Traceback" not in status.stderr, status.stderr
