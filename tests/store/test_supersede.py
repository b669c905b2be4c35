"""The supersede scripts on a real store: publish order ("S"), the unique replace and its
marker ("N"). The worker-level proof is tests/flow/test_supersede.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from celery_baton.core.conditions import (
    NotSuperseded,
    Penalty,
    PublishOrder,
    TakeLease,
    WeightedRate,
)
from celery_baton.core.gate import Gate
from celery_baton.core.keys import KeyNames
from celery_baton.core.supersede import Supersede
from celery_baton.store.connection import connect

NAMES = KeyNames("baton")
EX = NAMES.lease("t", "ex", "k")
SUP = NAMES.supersede("t", "k")
UQ = NAMES.unique("t", "u")


@pytest.fixture
def parts(store_url: str) -> Iterator[tuple[Gate, Supersede]]:
    store = connect(store_url, socket_timeout=2)
    yield Gate(store), Supersede(store, NAMES)
    store.client.close()


def ask(gate: Gate, order: int | None, task_id: str) -> object:
    conditions = [PublishOrder(SUP, order, task_id), TakeLease(EX, fence=True)]
    return gate.decide(conditions, owner=f"{task_id}|w|1", ttl=5)


def test_publish_order_grows_and_an_older_delivery_is_superseded(
    parts: tuple[Gate, Supersede],
) -> None:
    gate, supersede = parts
    orders = [supersede.stamp("t", "k") for _ in range(3)]
    assert orders == sorted(set(orders))  # strictly increasing, from the store
    newest = ask(gate, orders[2], "c")
    assert newest.granted  # type: ignore[attr-defined]
    older = ask(gate, orders[1], "b")  # arrives after the newer one: never runs
    assert not older.granted and isinstance(older.denied_by, PublishOrder)  # type: ignore[attr-defined]
    assert older.holder == "c" and older.retry_after == -1  # type: ignore[attr-defined]
    # A message without an order is given one now (newer than all): it is the newest.
    unstamped = ask(gate, None, "d")
    assert isinstance(unstamped.denied_by, TakeLease)  # type: ignore[attr-defined]  # c holds the key
    assert unstamped.seq > orders[2]  # type: ignore[attr-defined]
    assert isinstance(ask(gate, orders[2], "c").denied_by, PublishOrder)  # type: ignore[attr-defined]


def test_unique_replace_supersedes_a_queued_holder_and_leaves_a_running_one(
    parts: tuple[Gate, Supersede], r: redis.Redis
) -> None:
    gate, supersede = parts
    assert supersede.replace("t", UQ, "a", 60) == ("claimed", "")
    assert supersede.replace("t", UQ, "b", 60) == ("superseded", "a")
    assert r.get(UQ) == "b" and r.get(NAMES.superseded("t", "a")) == "b"
    marker_a = [NotSuperseded(NAMES.superseded("t", "a"), 60)]
    denied = gate.decide(marker_a, owner="a|w|1")
    assert not denied.granted and denied.holder == "b"
    # b starts (its marker becomes 'run'); a later replace leaves it running.
    assert gate.decide([NotSuperseded(NAMES.superseded("t", "b"), 60)], owner="b|w|1")
    assert supersede.replace("t", UQ, "c", 60) == ("running", "b")
    assert r.get(UQ) == "c"
    # The key moved meanwhile (another replace): followed to its new holder.
    r.set(UQ, "x")
    r.set(NAMES.superseded("t", "x"), "q")
    assert supersede.replace("t", UQ, "d", 60) == ("superseded", "x")


@pytest.mark.parametrize("kind", [WeightedRate, Penalty])
def test_a_named_limit_that_denies_still_returns_the_order_given(
    parts: tuple[Gate, Supersede], r: redis.Redis, kind: type
) -> None:
    """A delivery without a publish order is given one by its PublishOrder; a named
    limit (WeightedRate, Penalty) that denies it after must return that order too, or the
    worker asks again without one and is given a newer order than a publish that came
    between (superseding the newer message instead of being superseded by it)."""
    gate, _ = parts
    if kind is WeightedRate:
        limit = WeightedRate(NAMES.shared_rate("api"), 1_000_000, 1_000_000)
        assert gate.decide([limit], owner="x|w|1").granted  # the slot of the next second
    else:
        limit = Penalty(NAMES.shared_penalty("api"))
        seconds, micros = r.time()
        r.set(NAMES.shared_penalty("api"), (seconds + 60) * 1_000_000 + micros)
    denied = gate.decide([PublishOrder(SUP, None, "a"), limit], owner="a|w|1")
    assert not denied.granted and denied.denied_by is not None
    assert isinstance(denied.denied_by, kind)
    assert denied.seq == int(r.hget(SUP, "n") or 0) > 0
