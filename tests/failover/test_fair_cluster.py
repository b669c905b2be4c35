"""fair_key on a real Redis Cluster: the fairness state lives in the task's hash tag
family, so the gate's one script call (cap, turn, presences) runs on one slot."""

from __future__ import annotations

import pytest

from tests.failover.conftest import ProdStore
from tests.limits.test_fairness import a_then_b, assert_fair
from tests.support.cluster_topology import ClusterTopology
from tests.support.observer import Observer
from tests.support.workers import Workers


@pytest.fixture
def prod_store(cluster: ClusterTopology, cluster_url: str) -> ProdStore:
    return ProdStore("cluster", cluster_url, cluster)


def test_fair_key_shares_the_cap_on_cluster(prod_workers: Workers, observer: Observer) -> None:
    from tests.apps import fair

    # A's backlog as in tests/limits/test_fairness.py (400): with 200, A runs out before
    # the bound on the runs that start before B's first ask (the machine's publish and
    # fetch time) tells fair from FIFO on a loaded machine (110 of 188 seen, bound 94).
    share = a_then_b(prod_workers, observer, fair.fair_capped, 400)
    print(share.describe())
    assert_fair(share, 400)
