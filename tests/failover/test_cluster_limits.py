"""Named limits on a real Redis Cluster: a limit's keys hash to its own slot, a task's
to its family's, and one script cannot touch both. Reserve then confirm (Gate.decide):
the limit's slot first, then the task's own; a refusal gives back what was taken.

On Cluster a run's fence comes from the task's own call, made after the limit's (and
up to its reservation window before the limit's slot), so the budget is judged on the
observer's start stamps here, with a tolerance of half a unit (100 ms at 5/s): a run
admitted beyond the budget is a whole unit over.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from tests.failover.conftest import ProdStore
from tests.limits.test_shared import weighted_excess
from tests.support.cluster_topology import ClusterTopology
from tests.support.observer import Observer
from tests.support.workers import Workers

APP = "tests.apps.shared_limits"


@pytest.fixture
def prod_store(cluster: ClusterTopology, cluster_url: str) -> ProdStore:
    return ProdStore("cluster", cluster_url, cluster)


def start(workers: Workers, n: int = 2, **kw: Any) -> None:
    started = [workers.start(APP, wait=False, **kw) for _ in range(n)]
    for worker in started:
        worker.wait_ready()


def test_two_tasks_share_one_budget_across_slots(
    prod_workers: Workers, observer: Observer, cluster: ClusterTopology
) -> None:
    from tests.apps import shared_limits

    assert (
        cluster.master_of("baton:{limit:slow}:rate").port
        != cluster.master_of("baton:{tests.apps.shared_limits.slow_a}:x").port
    )  # the limit and the task's own keys live on different masters
    start(prod_workers, pool="solo", concurrency=1)
    numbers = itertools.count()
    for _ in range(6):
        shared_limits.slow_a.delay(n=next(numbers))
        shared_limits.slow_b.delay(n=next(numbers))
    runs = observer.wait_for(12, timeout=60)

    assert {r.key for r in runs} == {"slow_a:1", "slow_b:1"}
    starts = [(r.start, 1.0) for r in runs]
    assert weighted_excess(starts, 5, 2) <= 0.5, sorted(starts)
    span = (max(s for s, _ in starts) - min(s for s, _ in starts)) / 1e6
    assert 1.2 < span < 20  # (12 - 2) / 5 = 2 s


def test_a_refused_run_gives_its_reservation_back(
    prod_workers: Workers, observer: Observer
) -> None:
    """ "gb" admits 3 runs, then one a minute. A holds key k; B (same key) is refused by
    the exclusive lease after its "gb" reservation on the other slot: that reservation
    is given back, so A, B and then C (another key) all run within seconds. Without the
    give-back B's refused ask spent a unit and C waited a minute."""
    from tests.apps import shared_limits

    start(prod_workers, n=1, pool="threads", concurrency=3)
    shared_limits.one_at_a_time.delay("k", 1.5)
    observer.starts_of("k:1")
    shared_limits.one_at_a_time.delay("k", 0)
    runs = observer.runs_of("k:1", 2, timeout=20)  # B ran after A released k
    shared_limits.one_at_a_time.delay("other", 0)
    observer.runs_of("other:1", 1, timeout=15)
    assert len(runs) == 2
