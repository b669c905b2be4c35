"""Named limits against a real server: weighted GCRA, penalties, blocking use in code,
and the give-back of reserve-then-confirm (Gate.decide on Cluster)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from celery_baton.core.conditions import Penalty, WeightedRate
from celery_baton.core.gate import Gate
from celery_baton.core.keys import KeyNames
from celery_baton.core.shared_limits import NamedLimit, SharedLimit
from celery_baton.errors import CostError, LimitTimeout
from celery_baton.store.connection import connect

NAMES = KeyNames("bt")


@pytest.fixture
def gate(store_url: str, r: redis.Redis) -> Iterator[Gate]:
    r.delete(*(f"bt:{{limit:{n}}}:{k}" for n in ("ten", "two") for k in ("rate", "penalty")))
    store = connect(store_url, socket_timeout=2)
    yield Gate(store)
    store.client.close()


def limit(gate: Gate, name: str, per_second: float, burst: int) -> NamedLimit:
    return NamedLimit(gate, NAMES, SharedLimit(name, per_second, burst))


def test_costs_spend_the_bucket_by_weight(gate: Gate) -> None:
    """10/s with a bucket of 10: 6 + 4 pass at once, then 1 more must wait one
    interval per unit (0.1 s), and a cost of 10 waits for the whole bucket."""
    ten = limit(gate, "ten", 10, 10)
    assert ten.try_acquire(6).granted
    refused = ten.try_acquire(5)
    assert not refused.granted and 0.05 < refused.retry_after <= 0.1
    assert refused.denied_by is not None and isinstance(refused.denied_by, WeightedRate)
    assert ten.try_acquire(4).granted
    whole = ten.try_acquire(10)
    assert not whole.granted and 0.9 < whole.retry_after <= 1.0
    with pytest.raises(CostError, match="larger than the burst 10"):
        ten.try_acquire(11)


def test_penalty_holds_everyone_until_it_ends(gate: Gate) -> None:
    ten = limit(gate, "ten", 1000, 1000)
    assert 0.9 < ten.penalize(1.0) <= 1.0
    assert 0.9 < ten.penalize(0.2) <= 1.0  # a shorter penalty never shortens it
    refused = limit(gate, "ten", 1000, 1000).try_acquire(1)  # another user, same name
    assert not refused.granted and refused.denied_by is not None
    assert isinstance(refused.denied_by, Penalty) and 0.5 < refused.retry_after <= 1.0
    time.sleep(refused.retry_after + 0.01)
    assert ten.try_acquire(1).granted


def test_acquire_blocks_then_times_out(gate: Gate) -> None:
    two = NamedLimit(gate, NAMES, SharedLimit("two", 2, 2), cost=2, timeout=0.2)
    with two as decision:
        assert decision.granted
    with pytest.raises(LimitTimeout, match=r"no room for cost 2 within 0\.2s") as caught, two:
        pass
    assert caught.value.limit == "two" and caught.value.retry_after > 0.2
    began = time.monotonic()
    assert two.acquire(1, timeout=5).granted  # half a second for one unit at 2/s
    assert 0.3 < time.monotonic() - began < 5


def test_give_back_returns_a_refused_reservation(gate: Gate, r: redis.Redis) -> None:
    """What a cross-slot decision took from a named limit before the task's own keys
    refused is given back, once, and only before its TAT could have run out."""
    ten = limit(gate, "ten", 10, 10)
    taken = ten.try_acquire(10)
    assert taken.granted and not ten.try_acquire(1).granted
    group = ten.limit.conditions(NAMES, 10)
    gate._give_back([(group, taken)])
    assert ten.try_acquire(10).granted  # the whole bucket again: it was given back
    late = ten.try_acquire(0)
    assert late.granted
    stale = taken.__class__(True, at_us=taken.at_us - 2_000_000)  # written 2 s ago
    tat = r.get(NAMES.shared_rate("ten"))
    gate._give_back([(group, stale)])
    assert r.get(NAMES.shared_rate("ten")) == tat  # past its deadline: nothing given


def test_a_late_give_back_returns_only_what_no_later_take_could_have_used(gate: Gate) -> None:
    """A reservation given back after others took from the bucket: subtracting its
    whole increment would set the TAT below where it would be had it never been taken
    (a take that came later started its own count from its own now), and the next take
    would pass early: B then C overran ``burst + w x rate`` (seen on CI under load).
    Only what is left of the increment when it is given back is returned."""
    from tests.limits.test_shared import weighted_excess

    ten = limit(gate, "ten", 10, 10)  # 100 ms per unit, a bucket of 10
    a = ten.try_acquire(5)
    assert a.granted
    time.sleep(0.3)
    b = ten.try_acquire(5)  # the bucket is 5 + 5: B passes at once
    assert b.granted
    gate._give_back([(ten.limit.conditions(NAMES, 5), a)])
    deadline = time.monotonic() + 5
    c = ten.try_acquire(10)
    while not c.granted:
        assert time.monotonic() < deadline
        time.sleep(c.retry_after)
        c = ten.try_acquire(10)
    assert weighted_excess([(b.at_us, 5), (c.at_us, 10)], 10, 10) <= 1e-3


def test_give_backs_never_let_more_through_than_the_budget(gate: Gate) -> None:
    """Random takes, half of them given back (at once or a few ms later, as a refused
    cross-slot decision would): the takes that were kept never exceed ``burst + w x
    rate`` in any window, whatever the interleaving (server clock instants)."""
    import random

    from tests.limits.test_shared import weighted_excess

    rng = random.Random(15)
    ten = limit(gate, "ten", 2000, 6)  # 0.5 ms per unit, a bucket of 6
    kept: list[tuple[int, float]] = []
    pending: list[tuple[float, Any, Any]] = []
    for _ in range(1000):
        cost = rng.choice([1, 2, 3])
        decision = ten.try_acquire(cost)
        if decision.granted:
            if rng.random() < 0.5:
                pending.append((time.monotonic() + rng.random() * 0.003, cost, decision))
            else:
                kept.append((decision.at_us, cost))
        for item in [p for p in pending if p[0] <= time.monotonic()]:
            pending.remove(item)
            gate._give_back([(ten.limit.conditions(NAMES, item[1]), item[2])])
    assert len(kept) > 30
    assert weighted_excess(kept, 2000, 6) <= 1e-3
