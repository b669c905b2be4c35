"""A replica that was behind is promoted: the gate holds new leases for one ttl.

A master and its replica; the replica is cut off (``REPLICAOF NO ONE``: promoted, with
the data it had) after a family's epoch reached it, then a lease is granted on the old
master only. The promoted server has the epoch but not the lease. With the store-wide
epoch (one server) and without it (as on Cluster, where each shard has its own
history), a new lease there waits the grace, and the holder's renewal writes its lease
back under a new epoch id. A restart keeps what persistence kept: no grace.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from celery_baton.core.gate import Gate, HeldLease
from celery_baton.core.keys import KeyNames
from celery_baton.core.leases import Lease
from celery_baton.store.connection import connect
from tests.support.servers import StoreServer
from tests.support.waiting import wait_until

KEY = "baton:{p}:ex:job"


@pytest.fixture
def pair() -> Iterator[tuple[StoreServer, StoreServer]]:
    master = StoreServer(name="promo-master", persistent=False)
    replica = StoreServer(name="promo-replica", persistent=False)
    replica.extra_args = ["--replicaof", "127.0.0.1", str(master.port)]
    master.start()
    master.flushall()  # known new
    replica.start()
    # In sync before the test's first grant, so that what it writes reaches the replica
    # within milliseconds (and the promotion comes within the second gate.lua keeps the
    # server's replication id: a promoted replica must not take its old master's).
    with replica.client() as r:
        wait_until(
            lambda: r.info("replication").get("master_link_status") == "up",
            30,
            "the replica in sync",
        )
    yield master, replica
    replica.close()
    master.close()


def _gate(server: StoreServer, store_wide: bool) -> Gate:
    grace_key = KeyNames().store_epoch if store_wide else None
    return Gate(connect(server.url(), socket_timeout=5), grace_key=grace_key)


@pytest.mark.parametrize("store_wide", [True, False], ids=["one-server", "per-family"])
def test_a_promoted_replica_that_was_behind_grants_no_lease_for_one_ttl(
    pair: tuple[StoreServer, StoreServer], store_wide: bool
) -> None:
    master, replica = pair
    on_master = _gate(master, store_wide)
    assert Lease(on_master, "baton:{p}:ex:warm-up", ttl=30).acquire()
    with replica.client() as r:
        wait_until(lambda: r.exists(KeyNames().epoch("p")), 10, "the epoch on the replica")
        r.execute_command("REPLICAOF", "NO", "ONE")  # promoted, behind from now on
    holder = Lease(on_master, KEY, ttl=3)
    assert holder.acquire()
    with replica.client() as r:
        assert not r.exists(KEY)

    on_replica = _gate(replica, store_wide)
    assert not Lease(on_replica, KEY, ttl=3).acquire()  # the grace, not the missing lease
    (renewal,) = on_replica.renew([HeldLease(KEY, holder.owner, 1, 3, holder.epoch)])
    assert renewal.status == 2  # re-asserted under a new epoch id
    assert renewal.epoch.split()[0] != holder.epoch.split()[0]
    for _ in range(2):  # the holder renews on; the grace (3 s) ends meanwhile
        time.sleep(1.6)
        (renewal,) = on_replica.renew([HeldLease(KEY, holder.owner, 1, 3, renewal.epoch)])
        assert renewal.status == 1
    assert not Lease(on_replica, KEY, ttl=3).acquire()  # held by the holder again
    assert Lease(on_replica, "baton:{p}:ex:other", ttl=3).acquire()  # the grace is over


def test_a_restarted_master_keeps_its_epoch_without_a_grace() -> None:
    server = StoreServer(name="promo-restart")  # persistent: AOF fsynced on every write
    server.start()
    try:
        server.flushall()
        assert Lease(_gate(server, True), "baton:{p}:ex:a", ttl=30).acquire()
        server.restart()  # a new replication id, no second one: not a promotion
        assert Lease(_gate(server, True), "baton:{p}:ex:b", ttl=30).acquire()
        assert Lease(_gate(server, False), "baton:{p}:ex:c", ttl=30).acquire()
    finally:
        server.close()
