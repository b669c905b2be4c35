"""The supersede scripts on a real Redis Cluster: every key of one call shares a slot."""

from __future__ import annotations

from celery_baton.core.conditions import NotSuperseded, PublishOrder, TakeLease
from celery_baton.core.gate import Gate
from celery_baton.core.keys import KeyNames
from celery_baton.core.supersede import Supersede
from celery_baton.store.connection import connect

NAMES = KeyNames("baton")


def test_publish_order_and_unique_replace_run_on_a_cluster(cluster_url: str) -> None:
    store = connect(cluster_url, socket_timeout=2)
    gate, supersede = Gate(store), Supersede(store, NAMES)
    try:
        older, newer = supersede.stamp("t", "k"), supersede.stamp("t", "k")
        sup, ex = NAMES.supersede("t", "k"), NAMES.lease("t", "ex", "k")

        def ask(order: int, task_id: str) -> object:
            conditions = [PublishOrder(sup, order, task_id), TakeLease(ex)]
            return gate.decide(conditions, owner=f"{task_id}|w|1")

        assert ask(newer, "b").granted  # type: ignore[attr-defined]
        assert isinstance(ask(older, "a").denied_by, PublishOrder)  # type: ignore[attr-defined]
        uq = NAMES.unique("t", "u")
        assert supersede.replace("t", uq, "a", 60).status == "claimed"
        assert supersede.replace("t", uq, "b", 60) == ("superseded", "a")
        marker = [NotSuperseded(NAMES.superseded("t", "a"), 60)]
        assert gate.decide(marker, owner="a|w|1").holder == "b"
    finally:
        store.client.close()
