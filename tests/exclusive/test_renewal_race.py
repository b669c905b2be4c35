"""A renewal that lands after the release must not re-create the lease (issue 11, item 2).

The worker's renewer copies its held leases, then sends one renewal call. When the store
stalls, that call can reach the store after the run finished and its release was
executed: the renewer's connection was dropped by the stall, and redis-py's connect (with
its handshake, retried with back-off) sends the renewal only once the store answers
again -- after the release that waited in another connection's buffer. A renewal that
then "re-asserts" the missing lease gives a finished run its key back for a whole
``lease_ttl``: the next run of the key is skipped as held by a task that is over.

The test makes that order happen in a real worker: the store is paused (SIGSTOP) just
after a renewal, so the next one times out and the renewer reconnects while the store is
still paused; the run is told to finish only then (its release is queued in the store's
socket), and the store resumes. The next run of the key must run.
"""

from __future__ import annotations

import json
import time

import psutil
import redis

from tests.support.celery_processes import WorkerProcess
from tests.support.observer import Observer
from tests.support.servers import StoreServer
from tests.support.waiting import wait_until
from tests.support.workers import Workers

APP = "tests.apps.renewal"


def _deadline(r: redis.Redis, key: str) -> int | None:
    for field, value in r.hgetall(key).items():
        if field.startswith("o:"):
            return int(value.split()[0])
    return None


def _store_ports(worker: WorkerProcess, store_port: int) -> set[int]:
    """Local ports of the worker main process's connections to the store."""
    return {
        c.laddr.port
        for c in psutil.Process(worker.pid).net_connections(kind="tcp")
        if c.raddr and c.raddr.port == store_port
    }


def _renewals(r: redis.Redis, worker: WorkerProcess) -> int:
    report = r.get(f"baton:worker:{worker.hostname}")
    return int(json.loads(report)["renewals"]) if report else 0


def test_a_renewal_that_lands_after_the_release_does_not_hold_the_key(
    workers: Workers, observer: Observer, store_server: StoreServer
) -> None:
    from tests.apps.renewal import exclusive_key, hold, let_finish

    worker = workers.start(APP, concurrency=1)
    key = exclusive_key("k")
    first = hold.delay("k", True)
    observer.starts_of("k", 1, timeout=30)
    with store_server.client() as r:
        # Just after a renewal: the renewer's connection is open, its next call is ~1 s away.
        granted = _deadline(r, key)
        assert granted is not None
        wait_until(lambda: _deadline(r, key) != granted, 10, "a renewal of the lease")
        time.sleep(0.2)  # its status report follows the renewal
        renewals = _renewals(r, worker)
        ports = _store_ports(worker, store_server.port)
        store_server.pause()
        try:
            # The next renewal times out (2 s); the one after reconnects to the paused
            # store with its copy of the held leases, and waits 2 s in the handshake.
            paused = time.monotonic()
            wait_until(
                lambda: (
                    time.monotonic() - paused > 2.5
                    and bool(_store_ports(worker, store_server.port) - ports)
                ),
                15,
                "the renewer reconnecting to the paused store",
            )
            let_finish("k")  # the release is sent now, into the paused store
            observer.runs_of("k", 1, timeout=10)
            time.sleep(0.3)  # the main process hears of the end and writes the release
        finally:
            store_server.resume()
        assert first.get(timeout=20)
        # The renewal that carries the finished run's lease lands now, after the release.
        wait_until(lambda: _renewals(r, worker) > renewals, 20, "the late renewal")

    second = hold.delay("k")
    assert second.get(timeout=20) > first.get(timeout=1)  # it ran, with a newer fence
    assert [run.task_id for run in observer.runs_of("k", 2)] == [first.id, second.id]
    assert "re-asserted" not in worker.log_text()
    assert "lost its lease" not in worker.log_text()  # the finished run lost nothing
    assert "lease lost" not in worker.log_text()
