"""What a delivery asks for (worker/planning.py), without a worker or a store: its policy
(the task's, a call's options, a beat slot's run-once), Celery's runtime rate, its plan
under an owner of its own, and a new plan when that rate changed while it was held."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from celery_baton.config import Settings
from celery_baton.core.conditions import NotDone, Override, Rate
from celery_baton.core.keys import KeyNames
from celery_baton.core.policy.compile import compile_policy
from celery_baton.core.policy.headers import BEAT_SLOT_HEADER, CALL_HEADER, PUBLISH_HEADER
from celery_baton.core.policy.model import TaskPolicy
from celery_baton.core.policy.per_call import CallOptions
from celery_baton.errors import KeySpecError
from celery_baton.worker.holding import Delivery
from celery_baton.worker.planning import Planner

NAMES = KeyNames("baton")
SETTINGS = Settings()


def feed(url: str) -> None: ...


@dataclass
class Task:
    name: str = "t.feed"
    rate_limit: Any = None


@dataclass
class Request:
    """The attributes of Celery's Request that planning reads."""

    task: Task = field(default_factory=Task)
    id: str = "id-1"
    args: tuple[Any, ...] = ("u",)
    kwargs: dict[str, Any] = field(default_factory=dict)
    expires: Any = None
    request_dict: dict[str, Any] = field(default_factory=dict)


def planner(policies: dict[str, TaskPolicy | None], settings: Settings = SETTINGS) -> Planner:
    return Planner(
        policy_for=lambda task: policies.get(task.name),
        names=NAMES,
        settings=settings,
        hostname="w@h",
    )


def declared(**options: object) -> TaskPolicy | None:
    return compile_policy("t.feed", options.get, feed, SETTINGS)


def test_a_task_without_options_asks_nothing() -> None:
    assert planner({}).policy(Request()) is None


def test_a_call_header_gives_a_plain_task_a_policy_for_that_delivery() -> None:
    request = Request(request_dict={CALL_HEADER: CallOptions("tenant:1").to_header()})
    policy = planner({}).policy(request)
    assert policy is not None and policy.call_exclusive == "tenant:1"
    assert planner({}).policy(Request()) is None  # the next delivery: none


def test_a_beat_slot_runs_under_the_redelivery_guard() -> None:
    policy = planner({}).policy(Request(request_dict={BEAT_SLOT_HEADER: "1700000000000"}))
    assert policy is not None and policy.redelivery_guard


def test_the_guard_asks_about_the_publish_a_delivery_is() -> None:
    """The done marker is asked about this delivery's publish (its stamp), or about its
    task id alone when it has none (sent without celery-baton) or is a beat slot (the
    beat may send a slot twice: it runs once)."""
    policy = declared(redelivery_guard=True)
    assert policy is not None

    def done_condition(headers: dict[str, Any]) -> tuple[str, str, str]:
        plan = planner({}).plan(policy, Request(request_dict=headers), None)
        (condition,) = [c for c in plan.conditions if isinstance(c, NotDone)]
        assert plan.done_stamp == condition.stamp
        return condition.key, condition.stamp, condition.task_id

    assert done_condition({PUBLISH_HEADER: "5eed"}) == ("baton:{t.feed}:done:id-1", "5eed", "id-1")
    assert done_condition({})[1] == ""
    assert done_condition({PUBLISH_HEADER: 7})[1] == ""  # not ours
    assert done_condition({PUBLISH_HEADER: "5eed", BEAT_SLOT_HEADER: 1})[1] == ""


def test_every_plan_has_an_owner_of_its_own() -> None:
    policy = declared(exclusive="url")
    assert policy is not None
    plans = [planner({}).plan(policy, Request(), None) for _ in range(2)]
    assert plans[0].owner != plans[1].owner
    assert all(p.owner.startswith("id-1|w@h|") for p in plans)
    assert plans[0].exclusive_key == plans[1].exclusive_key


def test_arguments_that_cannot_build_a_key_are_refused() -> None:
    policy = declared(exclusive="url")
    assert policy is not None
    with pytest.raises(KeySpecError):
        planner({}).plan(policy, Request(args=(), kwargs={}), None)


def test_celerys_rate_is_read_as_celery_parses_it() -> None:
    p = planner({})
    assert p.celery_rate(Task(rate_limit="6/m")) == pytest.approx(0.1)
    assert p.celery_rate(Task(rate_limit=None)) is None
    assert p.celery_rate(Task(rate_limit="fast")) is None  # logged, not limiting


def test_a_held_delivery_is_planned_again_when_celerys_rate_changed() -> None:
    settings = Settings(global_rate_limits=True)
    policy = compile_policy("t.feed", {}.get, feed, settings)
    assert policy is not None and policy.rate_from_celery and policy.celery_rate_only
    p = planner({"t.feed": policy}, settings)
    request = Request(task=Task(rate_limit="6/m"))
    delivery = Delivery(request, policy, p.plan(policy, request, 0.1), 0, celery_rate=0.1)
    first = delivery.plan
    assert [type(c) for c in first.conditions] == [Override, Rate]  # `limits set` may override

    p.replan(delivery)  # unchanged: the same plan
    assert delivery.plan is first

    request.task.rate_limit = "60/m"
    p.replan(delivery)
    assert delivery.celery_rate == pytest.approx(1.0) and delivery.plan is not first
    new_rate, old_rate = delivery.plan.conditions[1], first.conditions[1]
    assert isinstance(new_rate, Rate) and isinstance(old_rate, Rate)
    assert new_rate.interval_us != old_rate.interval_us

    request.task.rate_limit = None  # lifted: nothing left to ask
    p.replan(delivery)
    assert delivery.celery_rate is None and delivery.plan.conditions == []
