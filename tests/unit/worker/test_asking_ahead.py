"""Asking ahead's pure parts (worker/asking_ahead.py): which plans may be asked before
their pool slot, when the pool counts as draining short tasks, and which delivery is
next; the real worker's side is tests/limits/test_ask_ahead.py."""

from __future__ import annotations

from celery_baton.core.conditions import (
    FreeUnique,
    NotDone,
    Override,
    Penalty,
    Rate,
    TakeLease,
    WeightedRate,
)
from celery_baton.core.policy.model import RunPlan, TaskPolicy
from celery_baton.worker.asking_ahead import AHEAD_BOUND, AskingAhead, eligible
from celery_baton.worker.holding import Delivery

POLICY = TaskPolicy(name="t", lease_ttl=8.0)


def delivery(*conditions: object, generation: int = 0, **plan: object) -> Delivery:
    made = Delivery(object(), POLICY, RunPlan("o", list(conditions), []), generation)  # type: ignore[arg-type]
    for name, value in plan.items():
        setattr(made.plan, name, value)
    made.waiting_slot = True
    return made


def test_only_plans_of_leases_and_rate_tokens_are_asked_ahead() -> None:
    assert eligible(delivery(TakeLease("k")))
    assert eligible(delivery(Override("l", "concurrency"), TakeLease("k", limit=3)))
    assert eligible(delivery(NotDone("d"), TakeLease("r")))  # the guard's
    # A token: lost if unused within the bound (asked ahead without a reservation).
    assert eligible(delivery(Override("l", "rate"), Rate("r", 1000), reserve=0.001))
    assert not eligible(delivery(TakeLease("k"), FreeUnique("u", "id")))  # freed at once
    assert not eligible(delivery(WeightedRate("w", 1000, 0)))  # a named limit's cost
    assert not eligible(delivery(Penalty("p"), TakeLease("k")))
    assert not eligible(delivery(TakeLease("k"), flow_key="f"))
    assert not eligible(delivery(TakeLease("k"), fair_limits={"f": "k"}))


def test_draining_means_slots_came_free_often_and_lately() -> None:
    ahead = AskingAhead()
    assert not ahead.draining(100.0)  # none yet
    for i in range(10):
        ahead.slot_came(100.0 + i * 0.002)
    assert ahead.draining(100.02)
    assert not ahead.draining(100.019 + AHEAD_BOUND)  # none lately
    slow = AskingAhead()
    for i in range(10):
        slow.slot_came(100.0 + i * AHEAD_BOUND)  # every 20 ms: not short enough
    assert not slow.draining(100.0 + 9 * AHEAD_BOUND + 0.001)


def test_the_candidate_is_the_first_waiter_once() -> None:
    ahead = AskingAhead()
    started = delivery(TakeLease("a"))
    started.waiting_slot = False  # got its slot
    forgotten = delivery(TakeLease("b"), generation=0)
    first, second = delivery(TakeLease("c"), generation=1), delivery(TakeLease("d"), generation=1)
    ahead.waiting.extend([started, forgotten, first, second])
    assert ahead.candidate(generation=1) is first
    assert list(ahead.waiting) == [first, second]  # the stale heads dropped
    ahead.current = first
    assert ahead.candidate(generation=1) is None  # one at a time
    ahead.done_with(first)
    first.asked_ahead = True
    assert ahead.candidate(generation=1) is None  # asked once; the next is behind it
    unique = AskingAhead()
    unique.waiting.append(delivery(TakeLease("k"), FreeUnique("u", "id"), generation=1))
    assert unique.candidate(generation=1) is None
