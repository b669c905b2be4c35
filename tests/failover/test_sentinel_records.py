"""A run's end, recorded on a Sentinel master that dies before its replica has it, still
keeps the run's copy from running (the redelivery guard's done marker; a beat slot's run
record is written by the same release).

What a loaded suite saw: a beat slot ran twice after the master was SIGKILLed. Its run
ended and was recorded on the old master; neither the record nor the leader's "sent"
mark had reached the replica, so the leader re-sent the slot under its id, and the new
master, after its grace, let the copy run.

Here the window is made to happen: the replica is cut off (REPLICAOF NO ONE: it keeps
what it had) while a guarded run ends, and its ack fails (the broker's writes
paused), so the broker gives the message back. The master is SIGKILLed once the end is
recorded on it, and the sentinels promote the replica, which never had the record. The
copy must be acked without running.
"""

from __future__ import annotations

import time

import pytest

from tests.failover.conftest import ProdStore
from tests.failover.test_sentinel import _wait_new_master
from tests.support.observer import Observer
from tests.support.run_ends import ACK_FAILED, assert_the_copy_does_not_run, holds_done_marker
from tests.support.sentinel_topology import SentinelTopology
from tests.support.servers import StoreServer
from tests.support.waiting import wait_until
from tests.support.workers import Workers

APP = "tests.apps.ackfail"


@pytest.fixture
def prod_store(sentinel: SentinelTopology, sentinel_url: str) -> ProdStore:
    return ProdStore("sentinel", sentinel_url, sentinel)


@pytest.mark.timeout(180)
def test_an_end_recorded_on_a_master_that_died_before_its_replica_had_it_still_stops_the_copy(
    prod_workers: Workers,
    observer: Observer,
    sentinel: SentinelTopology,
    broker_server: StoreServer,
) -> None:
    from tests.apps.ackfail import stop_mark, uq_ack_guarded

    worker = prod_workers.start(APP, concurrency=2)
    master, replica = sentinel.master(), sentinel.replica()
    first = uq_ack_guarded.delay("kr")
    wait_until(lambda: observer._redis.exists(stop_mark(first.id)), 30, "the run to ask")

    # The run returns in 1.5 s. The replica is cut off from its master first (as a
    # replica whose link broke: it keeps what it had and takes nothing more; a stopped
    # replica would still read what the master wrote to its socket), then the broker's
    # writes pause, so the ack after the run fails and the message comes back.
    with replica.client() as r:
        r.execute_command("REPLICAOF", "NO", "ONE")
    with broker_server.client() as admin:
        admin.execute_command("CLIENT", "PAUSE", 120_000, "WRITE")
        try:
            wait_until(lambda: ACK_FAILED in worker.log_text(), 60, "the ack to fail")
            time.sleep(1.0)  # the main process records the end again right after the line
            assert holds_done_marker(master, first.id), "the end was not recorded"
            assert not holds_done_marker(replica, first.id)
            master.kill()  # with the only record of the end
            _wait_new_master(sentinel, master, timeout=60)
            assert sentinel.master() is replica
        finally:
            admin.execute_command("CLIENT", "UNPAUSE")

    assert_the_copy_does_not_run(worker, observer, first.id)
