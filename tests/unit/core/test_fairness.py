"""fair_key and fair_weights: declaration errors, each call's plan, the verdict of a
refused turn, and the pure helpers; no worker, no store."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from celery import Celery

from celery_baton import Baton, ConfigError
from celery_baton.config import Settings
from celery_baton.core import fairness
from celery_baton.core.conditions import Condition, FairPart, FairTurn, Override, Rate, TakeLease
from celery_baton.core.gate import Decision
from celery_baton.core.keys import KeyNames, digest
from celery_baton.core.policy.compile import compile_policy
from celery_baton.core.policy.model import RunPlan
from celery_baton.core.policy.plan import plan_delivery
from celery_baton.worker.verdict import Reason, Wait, verdict

NAMES = KeyNames("baton")


def job(tenant: str, doc: int = 0) -> None: ...


def compile_(**options: Any) -> Any:
    return compile_policy("t.job", options.get, job, Settings())


def plan_of(tenant: str = "acme", **options: Any) -> RunPlan:
    policy = compile_(**options)
    assert policy is not None
    return plan_delivery(policy, NAMES, task_id="id", owner="id|w|1", args=(tenant,), kwargs={})


@pytest.fixture
def app() -> Iterator[Celery]:
    celery = Celery("fair-test", broker="memory://", set_as_current=False)
    Baton(celery, url="redis://127.0.0.1:1/0")
    yield celery
    celery.close()


# -- bad input, refused when the task is declared ---------------------------------------


def test_fair_key_without_a_shared_limit_is_refused(app: Celery) -> None:
    with pytest.raises(ConfigError, match="needs global_concurrency or global_rate_limit"):

        @app.task(fair_key="tenant")
        def t(tenant: str) -> None: ...


def test_fair_true_points_to_fair_key(app: Celery) -> None:
    with pytest.raises(ConfigError, match="did you mean `fair_key`"):

        @app.task(global_concurrency=4, global_concurrency_key="tenant", fair=True)
        def t(tenant: str) -> None: ...


@pytest.mark.parametrize("bad", [True, False])
def test_fair_key_must_name_what_shares_the_limit(bad: bool) -> None:
    with pytest.raises(ConfigError, match="fair_key must name"):
        compile_(global_concurrency=4, fair_key=bad)


def test_fair_key_naming_a_missing_argument_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"'tenat'.*does not take"):
        compile_(global_concurrency=4, fair_key="tenat")


def test_weights_without_fair_key_are_refused() -> None:
    with pytest.raises(ConfigError, match="fair_weights needs fair_key"):
        compile_(global_concurrency=4, fair_weights={"gold": 3})


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ({"gold": 0}, r"fair_weights\['gold'\].*> 0"),
        ({"gold": -1}, r"> 0 and <= 1000"),
        ({"gold": "3"}, r"got '3'"),
        ({"gold": True}, r"got True"),
        ({"gold": float("inf")}, r"got inf"),
        ({"gold": 5000}, r"<= 1000"),
        ([("gold", 3)], r"expected a mapping .* or a callable .*, got list"),
        (3, r"got int"),
    ],
)
def test_bad_weights_are_refused_with_what_is_wrong(weights: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        compile_(global_concurrency=4, fair_key="tenant", fair_weights=weights)


# -- the plan of one call -------------------------------------------------------------


def stride(condition: Condition) -> int:
    assert isinstance(condition, FairTurn)
    return condition.stride


def test_the_fair_condition_follows_the_shared_cap() -> None:
    plan = plan_of(global_concurrency=4, fair_key="tenant", fair_weights={"gold": 4})
    kinds = [type(c) for c in plan.conditions]
    assert kinds == [Override, TakeLease, FairTurn, FairPart, FairPart, FairPart]
    cap, fair = plan.conditions[1], plan.conditions[2]
    assert fair == FairTurn(
        fair.key, digest('{"tenant":"acme"}'), fairness.STRIDE, round(fairness.PRESENCE * 1000)
    )
    # Every key in the task's hash tag family: one Cluster slot for the whole call.
    assert all(c.key.startswith("baton:{t.job}:") for c in plan.conditions)
    assert plan.fair_queues == {cap.key: f"{cap.key}#{fair.fair_key}"}
    assert plan.fair_limits == {fair.key: cap.key}
    gold = plan_of("gold", global_concurrency=4, fair_key="tenant", fair_weights={"gold": 4})
    assert stride(gold.conditions[2]) == fairness.STRIDE // 4


def test_the_fair_condition_follows_the_primary_rate() -> None:
    plan = plan_of(global_rate_limit=["10/s", "100/m"], fair_key="tenant")
    assert [type(c) for c in plan.conditions] == [
        Override,
        Rate,
        FairTurn,
        FairPart,
        FairPart,
        FairPart,
        Rate,
    ]
    assert plan.fair_limits == {plan.conditions[2].key: plan.conditions[1].key}


def test_a_callable_weight_gets_the_key_value_and_a_bad_one_counts_as_one() -> None:
    seen = []

    def weight(value: Any) -> float:
        seen.append(value)
        return 2.0 if value == "gold" else float("nan")

    gold = plan_of("gold", global_concurrency=4, fair_key="tenant", fair_weights=weight)
    other = plan_of("tin", global_concurrency=4, fair_key="tenant", fair_weights=weight)
    assert seen == ["gold", "tin"]
    assert stride(gold.conditions[2]) == fairness.STRIDE // 2
    assert stride(other.conditions[2]) == fairness.STRIDE


def test_with_more_says_whether_others_of_the_key_wait_here() -> None:
    plan = plan_of(global_concurrency=4, fair_key="tenant")
    fair_key = plan.conditions[2].key
    asked = fairness.with_more(plan.conditions, lambda key: key == fair_key)
    assert asked[2] == replace(plan.conditions[2], more=True)
    assert asked[:2] == plan.conditions[:2] and asked[3:] == plan.conditions[3:]
    assert plan.conditions[2] == replace(asked[2], more=False)  # the plan is unchanged


# -- the verdict of a refused turn ----------------------------------------------------


def decide(decision: Decision, plan: RunPlan) -> Any:
    return verdict(
        decision, plan, task_name="t.job", task_id="id", conflict="skip",
        denied_since=None, now=1.0,
    )  # fmt: skip


def test_a_refused_turn_waits_in_the_caps_queue_and_renews_in_time() -> None:
    plan = plan_of(global_concurrency=4, fair_key="tenant")
    cap, fair = plan.conditions[1], plan.conditions[2]
    turn = decide(Decision(False, denied_by=fair, retry_after=30.0), plan)
    assert turn == Wait(Reason.FAIR, cap.key, fairness.REFRESH, True)
    full = decide(Decision(False, denied_by=cap, retry_after=30.0), plan)
    assert isinstance(full, Wait) and full.reason is Reason.CONCURRENCY
    assert full.delay == fairness.REFRESH  # capped: the worker's presence must not lapse


def test_a_refused_rate_turn_wakes_without_jitter() -> None:
    plan = plan_of(global_rate_limit="10/s", fair_key="tenant")
    rate, fair = plan.conditions[1], plan.conditions[2]
    turn = decide(Decision(False, denied_by=fair, retry_after=0.2), plan)
    assert isinstance(turn, Wait) and turn.key == rate.key and not turn.jitter
    assert turn.delay == pytest.approx(0.2 - 0.1 * 0.9)


def test_conditions_carry_their_stride_and_parts() -> None:
    parts = fairness.conditions("baton:{t}:fair:cc:x", "k", 500)
    assert parts[0] == FairTurn("baton:{t}:fair:cc:x", "k", 500, 6000)
    assert [c.key for c in parts[1:]] == [f"baton:{{t}}:fair:cc:x:{p}" for p in "qps"]


def test_a_request_leaving_unrun_leaves_each_turn_no_other_request_here_waits_for() -> None:
    conditions: list[Condition] = [
        TakeLease("cc", 4),
        *fairness.conditions("fair:cc", "d1", fairness.STRIDE),
        Rate("rate", 100_000),
        *fairness.conditions("fair:rate", "d2", fairness.STRIDE),
    ]
    owner = "x|worker1|7"
    calls = fairness.leave_calls(conditions, owner, lambda fair: fair == "fair:rate")
    assert calls == [(["fair:cc", "fair:cc:q", "fair:cc:p", "fair:cc:s"], ["d1", owner])]
    assert fairness.leave_calls(conditions, owner, lambda fair: True) == []
    assert len(fairness.leave_calls(conditions, owner, lambda fair: False)) == 2
    assert fairness.leave_calls([TakeLease("cc", 4)], owner, lambda fair: False) == []
