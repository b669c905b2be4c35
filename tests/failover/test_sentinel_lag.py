"""Sentinel fails over to a replica that was behind (issue 14 §3).

The replica is cut off from its master (``REPLICAOF NO ONE`` on it: it keeps the data
it had, as a replica whose link broke does), after the store-wide epoch and the task's
family epoch reached it. Leases are then granted on the master only, the master is
SIGKILLed, and the sentinels promote the replica: it has both epochs but none of the
leases of the runs still going. Before: arrivals for the same keys were granted at once,
beside the live holders (the epochs were there, so the store did not look forgetful).
Now the gate sees that the store's replication history changed (``master_replid``) and
holds every new lease for one lease ttl, while the holders write theirs back.
"""

from __future__ import annotations

import pytest

from tests.failover.conftest import ProdStore
from tests.failover.test_sentinel import _wait_new_master
from tests.support.observer import Observer, assert_fences_increase, assert_no_overlap
from tests.support.sentinel_topology import SentinelTopology
from tests.support.waiting import wait_until
from tests.support.workers import Workers

APP = "tests.apps.exclusive"
KEYS = [f"lagged-{n}" for n in range(4)]


@pytest.fixture
def prod_store(sentinel: SentinelTopology, sentinel_url: str) -> ProdStore:
    return ProdStore("sentinel", sentinel_url, sentinel)


def _has(server: object, key_part: str) -> bool:
    with server.client() as r:  # type: ignore[attr-defined]
        return any(key_part in k for k in r.keys("*"))


@pytest.mark.timeout(120)
def test_failover_to_a_replica_that_was_behind_gives_no_overlap(
    prod_workers: Workers, observer: Observer, sentinel: SentinelTopology
) -> None:
    from tests.apps.exclusive import ex_long

    # lease_ttl 6 s: holders renew every 2 s; arrivals come before the holders' runs end.
    worker = prod_workers.start(APP, concurrency=8, env={"BATON_TEST_LEASE_TTL": "6"})
    master, replica = sentinel.master(), sentinel.replica()
    # Both epochs reach the replica before it falls behind.
    assert ex_long.delay("warm-up", 0).get(timeout=30) is not None
    wait_until(lambda: _has(replica, ":epoch"), 10, "the epochs on the replica")
    with replica.client() as r:
        r.execute_command("REPLICAOF", "NO", "ONE")  # from now on it lags

    holders = [ex_long.delay(key, 9.0) for key in KEYS]
    wait_until(
        lambda: len([s for s in observer.started() if s["key"] in KEYS]) == len(KEYS),
        20,
        "the 4 holders started",
    )
    assert not _has(replica, "lagged-")  # the replica lacks the holders' leases
    master.kill()
    _wait_new_master(sentinel, master)
    assert sentinel.master() is replica
    arrivals = [ex_long.delay(key, 0.2) for key in KEYS]

    for result in holders + arrivals:
        assert result.get(timeout=60) is not None  # nothing lost
    runs = [r for r in observer.runs() if r.key in KEYS]
    assert len(runs) == 2 * len(KEYS), runs
    assert_no_overlap(runs)
    assert_fences_increase(runs)
    log = worker.log_text()
    assert "the store is new or lost its data" in log  # the grace
    assert "lease re-asserted after the store lost it" in log  # holders wrote theirs back
