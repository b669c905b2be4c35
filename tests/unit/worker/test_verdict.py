"""Admission's verdict, case by case, without a worker or a store."""

from __future__ import annotations

import pytest

from celery_baton.config import Settings
from celery_baton.core.conditions import ClaimUnique, NotDone, Rate, TakeLease
from celery_baton.core.gate import Decision
from celery_baton.core.keys import KeyNames
from celery_baton.core.policy.compile import compile_policy
from celery_baton.core.policy.model import RunPlan
from celery_baton.core.policy.plan import plan_delivery
from celery_baton.worker.verdict import SKIP_GRACE, Reason, Skip, Start, Wait, verdict

NAMES = KeyNames("baton")


def feed(feed_url: str) -> None: ...


def plan_of(**options: object) -> RunPlan:
    policy = compile_policy("t.feed", options.get, feed, Settings())
    assert policy is not None
    return plan_delivery(policy, NAMES, task_id="id-2", owner="id-2|w|1", args=("u",), kwargs={})


def denied(plan: RunPlan, kind: type, *, holder: str = "id-1|w|9", retry: float = 1.0) -> Decision:
    condition = next(c for c in plan.conditions if isinstance(c, kind))
    return Decision(False, denied_by=condition, retry_after=retry, holder=holder)


def decide(
    decision: Decision,
    plan: RunPlan,
    *,
    conflict: str = "skip",
    since: float | None = None,
    now: float = 100.0,
) -> object:
    return verdict(
        decision, plan, task_name="t.feed", task_id="id-2", conflict=conflict,
        denied_since=since, now=now,
    )  # fmt: skip


def test_granted_starts_with_its_fence_and_reserved_start() -> None:
    plan = plan_of(exclusive="feed_url")
    assert decide(Decision(True, fence=7, start_after=0.2), plan) == Start(7, 0.2)


def test_exclusive_skip_waits_a_grace_first_then_skips() -> None:
    plan = plan_of(exclusive="feed_url")
    first = decide(denied(plan, TakeLease, retry=30.0), plan, since=None)
    assert isinstance(first, Wait) and first.reason is Reason.EXCLUSIVE
    assert first.delay == pytest.approx(SKIP_GRACE)
    later = decide(denied(plan, TakeLease, retry=30.0), plan, since=100.0, now=100.0 + SKIP_GRACE)
    assert isinstance(later, Skip) and later.reason is Reason.EXCLUSIVE
    assert later.holder == "id-1" and "held by task id-1" in later.message


def test_exclusive_wait_waits_as_long_as_the_gate_says() -> None:
    plan = plan_of(exclusive="feed_url", exclusive_conflict="wait")
    result = decide(denied(plan, TakeLease, retry=3.0), plan, conflict="wait")
    assert result == Wait(Reason.EXCLUSIVE, plan.exclusive_key or "", 3.0)


def test_a_copy_of_the_same_task_id_always_waits() -> None:
    plan = plan_of(exclusive="feed_url")
    result = decide(denied(plan, TakeLease, holder="id-2|w2|1"), plan, since=0.0)
    assert isinstance(result, Wait) and result.reason is Reason.EXCLUSIVE


def test_a_finished_task_id_is_skipped_as_already_run() -> None:
    plan = plan_of(redelivery_guard=True)
    result = decide(denied(plan, NotDone, holder="id-2", retry=-1.0), plan)
    assert isinstance(result, Skip) and result.reason is Reason.ALREADY_RUN


def test_a_call_published_unclaimed_whose_key_another_holds_is_skipped_as_a_duplicate() -> None:
    policy = compile_policy("t.feed", {"unique": "feed_url"}.get, feed, Settings())
    assert policy is not None
    plan = plan_delivery(
        policy, NAMES, task_id="id-2", owner="id-2|w|1", args=("u",), kwargs={}, unclaimed=True
    )
    result = decide(denied(plan, ClaimUnique, holder="id-1", retry=-1.0), plan)
    assert isinstance(result, Skip) and result.reason is Reason.DUPLICATE
    assert result.holder == "id-1" and "task id-1 with the same unique key" in result.message


def test_a_running_copy_under_the_guard_waits() -> None:
    plan = plan_of(redelivery_guard=True)
    condition = TakeLease(plan.run_key or "")
    result = decide(Decision(False, denied_by=condition, retry_after=2.0, holder="id-2|w|3"), plan)
    assert isinstance(result, Wait) and result.reason is Reason.RUNNING_COPY


def test_concurrency_waits_with_jitter() -> None:
    plan = plan_of(global_concurrency=2)
    result = decide(denied(plan, TakeLease, retry=0.5), plan)
    assert result == Wait(Reason.CONCURRENCY, result.key, 0.5, jitter=True)  # type: ignore[union-attr]


def test_rate_waits_without_jitter_and_asks_inside_the_reservation_window() -> None:
    plan = plan_of(global_rate_limit="2/s")
    assert plan.reserve == pytest.approx(0.5)
    result = decide(denied(plan, Rate, retry=0.5), plan)
    assert isinstance(result, Wait) and result.reason is Reason.RATE and not result.jitter
    assert result.delay == pytest.approx(0.5 - 0.45)
