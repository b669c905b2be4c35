"""ordered= on the production stores, and when the store forgets: the order record and
the key's lease share the task's hash tag, so the gate's one call and the release run on
one Redis Cluster slot; the same workload keeps its order on Redis Cluster and behind
Sentinel; a store that restarts empty loses the lines, never a call."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from types import ModuleType

import pytest

from celery_baton.core.conditions import InOrder, TakeLease
from celery_baton.core.gate import Gate, Release
from celery_baton.core.keys import KeyNames
from celery_baton.core.ordered import OrderedStamps
from celery_baton.store.connection import connect
from tests.failover.conftest import ProdStore
from tests.ordered.test_ordered import inversions, publish
from tests.support.observer import Observer, assert_no_overlap
from tests.support.servers import StoreServer
from tests.support.workers import Workers

NAMES = KeyNames("baton")


def test_the_ordered_scripts_run_on_a_cluster(cluster_url: str) -> None:
    store = connect(cluster_url, socket_timeout=2)
    gate, stamps = Gate(store), OrderedStamps(store, NAMES)
    record, lease = NAMES.ordered("t", "k"), NAMES.lease("t", "ex", "k")
    try:
        first, second = stamps.take("t", "k"), stamps.take("t", "k")

        def ask(header: str, owner: str) -> object:
            conditions = [InOrder(record, header, 60_000, 60_000), TakeLease(lease)]
            return gate.decide(conditions, owner=f"{owner}|w|1")

        assert not ask(second.header(), "b").granted  # type: ignore[attr-defined]
        assert ask(first.header(), "a").granted  # type: ignore[attr-defined]
        order = f"{first.epoch} {first.position} 1 0"
        gate.release_many(
            [Release((lease,), "a|w|1", order=order, order_key=record, order_lease=lease)]
        )
        assert ask(second.header(), "b").granted  # type: ignore[attr-defined]
    finally:
        store.client.close()


def test_ordered_keeps_publish_order_on_the_production_store(
    prod_workers: Workers,
    observer: Observer,
    prod_store: ProdStore,
    use_store: Callable[[ModuleType, str], None],
) -> None:
    from tests.apps import ordered
    from tests.apps.ordered import ordered_apply

    use_store(ordered, prod_store.url)  # places are taken where the workers read them
    for _ in range(2):
        prod_workers.start("tests.apps.ordered", concurrency=2)
    sent = publish(ordered_apply, [f"c{k}" for k in range(4)], 15, lambda n: 0.01)

    runs = observer.wait_for(len(sent), timeout=90)

    assert {r.task_id for r in runs} == set(sent)
    assert inversions(observer.started(), sent) == 0
    assert_no_overlap(runs)


@pytest.fixture
def forgetful() -> Iterator[StoreServer]:
    server = StoreServer(name="forgetful", persistent=False)
    server.start()
    server.flushall()  # known new: no grace at the first lease
    yield server
    server.close()


def test_a_store_that_restarts_empty_runs_the_waiting_calls_in_arrival_order(
    workers: Workers,
    observer: Observer,
    forgetful: StoreServer,
    use_store: Callable[[ModuleType, str], None],
) -> None:
    """The store restarts empty while call 0 runs and calls 1-2 wait: nothing is lost,
    nothing overlaps (the store's grace keeps the key until call 0's worker re-asserts
    its lease); the waiting calls run in arrival order, one at a time, logged; a new
    publish starts a new line."""
    from tests.apps import ordered
    from tests.apps.ordered import ordered_apply

    use_store(ordered, forgetful.url(0))
    worker = workers.start("tests.apps.ordered", env={"BATON_URL": forgetful.url(0)})
    results = [ordered_apply.delay("f", n, 3.0 if n == 0 else 0.0) for n in range(3)]
    observer.starts_of("f")
    forgetful.restart(kill=True, down_for=0.5)  # back empty: the line and the lease gone
    results.append(ordered_apply.delay("f", 3))

    assert [r.get(timeout=60) for r in results] == [0, 1, 2, 3]
    assert_no_overlap(observer.runs())
    assert "no longer has" in worker.log_text()
