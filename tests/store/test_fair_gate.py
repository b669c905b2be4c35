"""Fairness across keys (``fair_key``) in the gate script, against a real server.

Each test plays the workers' asks by hand, in the order least favourable to the key
that should win (the big tenant always asks first), and reads the decisions.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace

import pytest
import redis

from celery_baton.core import fairness
from celery_baton.core.conditions import Condition, FairTurn, Rate, TakeLease
from celery_baton.core.gate import Decision, Gate
from celery_baton.core.leases import new_owner

CC = "baton:{t}:cc:shared"
RATE = "baton:{t}:rate:shared"
FAIR = "baton:{t}:fair:cc:shared"
FAIR_RATE = "baton:{t}:fair:rate:shared"


@pytest.fixture
def gate(store_url: str) -> Iterator[Gate]:
    from celery_baton.store.connection import connect

    store = connect(store_url, socket_timeout=2)
    yield Gate(store)
    store.client.close()


def fair_conditions(
    base: str, tenant: str, *, weight: float = 1.0, more: bool = True, presence_ms: int = 6000
) -> list[Condition]:
    stride = round(fairness.STRIDE / weight)
    conditions = fairness.conditions(base, tenant, stride)
    conditions[0] = replace(conditions[0], more=more, presence_ms=presence_ms)  # type: ignore[type-var]
    return conditions


def ask_cc(gate: Gate, tenant: str, worker: str, limit: int, **kw: object) -> tuple[Decision, str]:
    owner = new_owner(f"{tenant}-task", worker)
    conditions = [TakeLease(CC, limit=limit), *fair_conditions(FAIR, tenant, **kw)]  # type: ignore[arg-type]
    return gate.decide(conditions, owner=owner, ttl=30), owner


def release(gate: Gate, owner: str) -> None:
    gate.release([CC], owner=owner)


def test_a_free_slot_goes_to_the_key_that_ran_least_recently(gate: Gate, r: redis.Redis) -> None:
    """Cap 2, tenant a has taken both slots; b starts waiting. Every freed slot: a asks
    first, yet the grants alternate b, a, b, a (round-robin), and a's turn-denial is a
    FAIR refusal that leaves the release notice armed."""
    running = []
    for _ in range(2):
        decision, owner = ask_cc(gate, "a", "w1", 2)
        assert decision.granted
        running.append(owner)
    denied, _ = ask_cc(gate, "b", "w2", 2)
    assert not denied.granted and denied.denied_by is not None
    assert isinstance(denied.denied_by, TakeLease)  # the cap is full: b now waits in the store

    order = []
    for _ in range(6):
        release(gate, running.pop(0))
        first, owner_a = ask_cc(gate, "a", "w1", 2)  # a always asks first
        if first.granted:
            order.append("a")
            running.append(owner_a)
            continue
        assert first.denied_by is not None and isinstance(first.denied_by, FairTurn)
        assert r.hget(CC, "_w") == "1"  # the next release wakes a again
        second, owner_b = ask_cc(gate, "b", "w2", 2)
        assert second.granted
        order.append("b")
        running.append(owner_b)
    assert order == ["b", "a", "b", "a", "b", "a"]


def test_weights_give_grants_in_proportion(gate: Gate) -> None:
    """gold weight 3, free weight 1, cap 1, both always waiting: 3 gold per free."""
    decision, running = ask_cc(gate, "free", "w1", 1)
    assert decision.granted
    ask_cc(gate, "gold", "w2", 1, weight=3)
    counts = {"gold": 0, "free": 0}
    for _ in range(16):
        release(gate, running)
        for tenant, weight in (("free", 1.0), ("gold", 3.0)):
            decision, owner = ask_cc(gate, tenant, f"w-{tenant}", 1, weight=weight)
            if decision.granted:
                counts[tenant] += 1
                running = owner
                break
        else:
            pytest.fail("a free slot was granted to nobody")
    # 3:1 up to the rounding of a stride (1e6 / 3): one grant either way.
    assert abs(counts["gold"] - 12) <= 1 and counts["gold"] + counts["free"] == 16


def test_a_key_that_stops_waiting_lets_the_others_use_every_slot(
    gate: Gate, r: redis.Redis
) -> None:
    """b's worker asked for its last request (more=0): b leaves the queue, and a takes
    every free slot at once; when nothing waits, the state is gone."""
    decision, holder = ask_cc(gate, "a", "w1", 1)
    assert decision.granted
    assert not ask_cc(gate, "b", "w2", 1)[0].granted
    release(gate, holder)
    granted, b_owner = ask_cc(gate, "b", "w2", 1, more=False)
    assert granted.granted
    assert r.zrange(f"{FAIR}:q", 0, -1) == ["a"]
    release(gate, b_owner)
    last, _ = ask_cc(gate, "a", "w1", 1, more=False)
    assert last.granted
    assert r.zcard(f"{FAIR}:q") == 0 and r.zcard(f"{FAIR}:p") == 0
    assert 0 < r.pttl(FAIR) <= 12_000  # expires: keys with nothing waiting cost nothing


def test_a_key_whose_worker_died_stops_blocking_after_its_presence(gate: Gate) -> None:
    """b's only worker vanished while b was first in line: its presence is not renewed,
    so once it lapses (300 ms here) a gets the free slot."""
    decision, holder = ask_cc(gate, "a", "w1", 1, presence_ms=300)
    assert decision.granted
    assert not ask_cc(gate, "b", "dead", 1, presence_ms=300)[0].granted
    release(gate, holder)
    refused, _ = ask_cc(gate, "a", "w1", 1, presence_ms=300)
    assert not refused.granted and refused.denied_by is not None
    assert isinstance(refused.denied_by, FairTurn) and 0 < refused.retry_after <= 0.2
    time.sleep(0.4)
    assert ask_cc(gate, "a", "w1", 1, presence_ms=300)[0].granted


def test_a_shared_rate_is_shared_round_robin(gate: Gate) -> None:
    """A rate of one per 50 ms: a asks first for every slot, yet b gets every other."""
    interval = 50_000

    def ask(tenant: str) -> Decision:
        conditions = [Rate(RATE, interval), *fair_conditions(FAIR_RATE, tenant)]
        return gate.decide(conditions, owner=new_owner(tenant, f"w-{tenant}"))

    assert ask("a").granted
    first_b = ask("b")
    assert not first_b.granted and first_b.denied_by is not None
    order = []
    deadline = time.monotonic() + 5
    while len(order) < 6 and time.monotonic() < deadline:
        a = ask("a")
        if a.granted:
            order.append("a")
            continue
        assert a.denied_by is not None
        if isinstance(a.denied_by, FairTurn):
            assert ask("b").granted
            order.append("b")
            continue
        time.sleep(a.retry_after)
    assert order == ["b", "a", "b", "a", "b", "a"]
