"""A run's end, recorded on a Redis Cluster shard master that dies before its replica has
it, still keeps the run's copy from running (the redelivery guard's done marker; a beat
slot's run record is written by the same release).

As on Sentinel (test_sentinel_records.py): the replica of the shard that holds the
task's keys is cut off from its master (it keeps what it had) while a guarded run ends,
and the run's ack fails (the broker's writes paused), so the broker gives the message
back. The master is SIGKILLed once the end is recorded on it, and the cluster promotes
the replica, which never had the record.

Unlike Sentinel, nothing tells a worker of one shard's new master, and a worker that
meets the shard's grace (gate.lua "E") writes back only its own ends. So the copy is
judged by another worker: the one that recorded the end stops consuming (as when a
busy worker's prefetch is full, or the copy lands elsewhere among many workers), and
its own report lives on another shard (it would notice that one forgetting, not this
one). The copy must still be acked without running.
"""

from __future__ import annotations

import secrets
import socket
import time

import pytest

from tests.failover.conftest import ProdStore
from tests.failover.test_cluster_forgets import cut_off
from tests.support.cluster_topology import ClusterNode, ClusterTopology
from tests.support.observer import Observer
from tests.support.run_ends import ACK_FAILED, assert_the_copy_does_not_run, holds_done_marker
from tests.support.servers import StoreServer
from tests.support.waiting import broadcast, wait_until
from tests.support.workers import Workers

APP = "tests.apps.ackfail"
#: The hash tag of every store key of the guarded task (core/keys.py KeyNames.family).
FAMILY = "{tests.apps.ackfail.uq_ack_guarded}"


@pytest.fixture
def prod_store(cluster: ClusterTopology, cluster_url: str) -> ProdStore:
    return ProdStore("cluster", cluster_url, cluster)


def _hostname_reporting_off(cluster: ClusterTopology, shard: ClusterNode) -> str:
    """A worker hostname whose report (``baton:worker:<hostname>``) lives on another
    shard than ``shard``: that worker's own report never tells it ``shard`` forgot."""
    host = socket.gethostname()
    while True:
        hostname = f"ends-{secrets.token_hex(3)}@{host}"
        if cluster.master_of(f"baton:worker:{hostname}") is not shard:
            return hostname


@pytest.mark.timeout(180)
def test_an_end_recorded_on_a_shard_master_that_died_before_its_replica_had_it_still_stops_the_copy(
    prod_workers: Workers,
    observer: Observer,
    cluster: ClusterTopology,
    broker_server: StoreServer,
) -> None:
    from tests.apps.ackfail import app, stop_mark, uq_ack_guarded

    master = cluster.master_of(f"baton:{FAMILY}:done:x")
    replica = cluster.replica_of(master)
    recorder = prod_workers.start(
        APP, concurrency=1, hostname=_hostname_reporting_off(cluster, master)
    )
    first = uq_ack_guarded.delay("kc")
    wait_until(lambda: observer._redis.exists(stop_mark(first.id)), 30, "the run to ask")
    # The recorder takes no more messages: the copy goes to the judge, started below.
    # (Not waited for: the run returns in 1.5 s and the broker must be paused first.)
    broadcast(
        app,
        lambda: app.control.cancel_consumer("celery", destination=[recorder.hostname]),
    )

    # The run returns in 1.5 s: the replica is cut off first (it keeps what it had and
    # takes nothing more), then the broker's writes pause, so the ack after the run
    # fails and the message comes back.
    with cut_off(replica), broker_server.client() as admin:
        admin.execute_command("CLIENT", "PAUSE", 120_000, "WRITE")
        try:
            wait_until(lambda: ACK_FAILED in recorder.log_text(), 60, "the ack to fail")
            time.sleep(1.0)  # the main process records the end right after the line
            assert holds_done_marker(master, first.id), "the end was not recorded"
            assert not holds_done_marker(replica, first.id)
            master.kill()  # with the only record of the end
            wait_until(lambda: replica.role() == "master", 30, "the replica promoted")
        finally:
            admin.execute_command("CLIENT", "UNPAUSE")
    assert cluster.master_of(f"baton:{FAMILY}:done:x") is replica

    judge = prod_workers.start(APP, concurrency=2)
    assert_the_copy_does_not_run(judge, observer, first.id)
