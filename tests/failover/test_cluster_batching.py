"""Batching on a Redis Cluster store (issue 37): a key's batch state is in one hash slot
(``{batch:<task>:<key>}``), so every batch script runs on the node of its key; keys
spread over the masters. Broker and observer stay on the broker server."""

from __future__ import annotations

from tests.batching.test_batching import APP, assert_each_call_once, call_ids, settle
from tests.support.cluster_topology import ClusterTopology
from tests.support.observer import Observer
from tests.support.workers import Workers


def test_batches_of_keys_spread_over_the_cluster_run_each_call_once(
    workers: Workers, observer: Observer, cluster: ClusterTopology, cluster_url: str
) -> None:
    from tests.apps.batching import index

    env = {"BATON_URL": cluster_url}
    started = [workers.start(APP, concurrency=2, env=env, wait=False) for _ in range(2)]
    for worker in started:
        worker.wait_ready()
    results = {}
    for n in range(80):
        account = f"c{n % 8}"  # 8 keys: their slots spread over the 3 masters
        result = index.apply_async(kwargs={"account": account, "doc": n})
        results[result.id] = (result, n)
    runs = settle(observer, "index", len(results), timeout=90)
    assert all("|" not in r.key for r in runs), "a run held calls of two keys"
    assert_each_call_once(runs, list(results))
    for result, doc in results.values():
        assert result.get(timeout=30) == doc * 2
    assert max(len(call_ids(r)) for r in runs) <= 10
