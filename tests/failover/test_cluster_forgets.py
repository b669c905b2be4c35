"""Safe when the store forgets, on Redis Cluster (issue 14 §3).

On Cluster no script can read a store-wide key (every call's keys share one slot), so a
task family's epoch, on the family's shard, is all the gate has: when it is missing,
nothing in the store tells a shard that lost its data from a family never used. Two
ways to get there, with exclusive runs in progress and new arrivals for the same keys,
judged from outside (the observer):

* the family's shard master restarts empty (no persistence; its replica is told not to
  fail over, so the master comes back with its slots and the replica resyncs from it);
* the shard's replica falls behind (cut off from its master), the family's first
  leases are granted on the master after that, and the master is SIGKILLed: the
  replica is promoted without the family's epoch or leases.

Before: the arrivals were granted at once, beside the live holders. Now the gate asks
the server: a master that started less than one lease ttl ago, or that was promoted
from a replica, gives a family whose epoch is missing a grace of one ttl, while the
holders write their leases back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from tests.failover.conftest import ProdStore
from tests.support.cluster_topology import ClusterNode, ClusterTopology
from tests.support.observer import Observer, assert_fences_increase, assert_no_overlap
from tests.support.status_watch import status_watch
from tests.support.waiting import wait_until
from tests.support.workers import Workers

APP = "tests.apps.exclusive"
KEYS = [f"forgotten-{n}" for n in range(4)]


@pytest.fixture
def prod_store(cluster: ClusterTopology, cluster_url: str) -> ProdStore:
    return ProdStore("cluster", cluster_url, cluster)


@contextlib.contextmanager
def no_failover(replica: ClusterNode) -> Iterator[None]:
    """The replica does not take over while its master is down (its master then comes
    back with its slots, as after a restart faster than the cluster's node timeout)."""
    with replica.client() as r:
        r.config_set("cluster-replica-no-failover", "yes")
    try:
        yield
    finally:
        with replica.client() as r:
            r.config_set("cluster-replica-no-failover", "no")


@contextlib.contextmanager
def cut_off(replica: ClusterNode) -> Iterator[None]:
    """The replica's link to its master breaks and stays broken (it cannot authenticate):
    it keeps the data it had, falls behind from now on, and may still be promoted."""
    with replica.client() as r:
        r.config_set("masterauth", "not-the-password")
        r.execute_command("CLIENT", "KILL", "TYPE", "master")
        wait_until(
            lambda: r.info("replication").get("master_link_status") == "down", 10, "link down"
        )
    try:
        yield
    finally:
        with replica.client() as r:
            r.config_set("masterauth", "")


def _family_keys(node: ClusterNode, family: str) -> list[str]:
    with node.client() as r:
        return [k for k in r.keys("*") if family in k]


def _check(runs_of_keys: list[object], log: str) -> None:
    assert_no_overlap(runs_of_keys)  # type: ignore[arg-type]
    assert_fences_increase(runs_of_keys)  # type: ignore[arg-type]
    assert "the store is new or lost its data" in log  # the grace
    assert "lease re-asserted after the store lost it" in log  # holders wrote theirs back


@pytest.mark.timeout(150)
def test_a_shard_restarted_empty_grants_no_lease_while_holders_write_theirs_back(
    prod_workers: Workers, observer: Observer, cluster: ClusterTopology
) -> None:
    from tests.apps.exclusive import ex_long, exclusive_key

    # lease_ttl 9 s: holders renew every 3 s, so arrivals right after the restart come
    # before the holders' next renewal (as in production, with 30 s and 10 s).
    worker = prod_workers.start(APP, concurrency=8, env={"BATON_TEST_LEASE_TTL": "9"})
    victim = cluster.master_of(exclusive_key(ex_long, KEYS[0]))
    with no_failover(cluster.replica_of(victim)), status_watch(APP, prod_workers.env) as graces:
        holders = [ex_long.delay(key, 6.0) for key in KEYS]
        wait_until(lambda: len(observer.started()) == len(KEYS), 30, "the 4 holders started")
        victim.restart_empty()  # every lease of the shard forgotten, its replica's too
        assert cluster.master_of(exclusive_key(ex_long, KEYS[0])) is victim
        arrivals = [ex_long.delay(key, 0.2) for key in KEYS]
        wait_until(lambda: "ex_long" in graces(), 20, "grace in status")

        for result in holders + arrivals:
            assert result.get(timeout=60) is not None  # nothing lost
    runs = observer.runs()
    assert len(runs) == 2 * len(KEYS), runs
    _check(runs, worker.log_text())


@pytest.mark.timeout(150)
def test_a_family_first_used_after_the_replica_fell_behind_waits_on_the_promoted_replica(
    prod_workers: Workers, observer: Observer, cluster: ClusterTopology
) -> None:
    from tests.apps.exclusive import ex_long, exclusive_key

    worker = prod_workers.start(APP, concurrency=8, env={"BATON_TEST_LEASE_TTL": "6"})
    victim = cluster.master_of(exclusive_key(ex_long, KEYS[0]))
    replica = cluster.replica_of(victim)
    with cut_off(replica):
        # The family's first leases: on the master only.
        holders = [ex_long.delay(key, 9.0) for key in KEYS]
        wait_until(lambda: len(observer.started()) == len(KEYS), 30, "the 4 holders started")
        assert _family_keys(victim, "ex_long}:epoch")
        assert not _family_keys(replica, "ex_long")  # neither its epoch nor its leases
        victim.kill()
        wait_until(lambda: replica.role() == "master", 20, "the replica promoted")
        arrivals = [ex_long.delay(key, 0.2) for key in KEYS]

        for result in holders + arrivals:
            assert result.get(timeout=60) is not None  # nothing lost
    runs = observer.runs()
    assert len(runs) == 2 * len(KEYS), runs
    _check(runs, worker.log_text())
