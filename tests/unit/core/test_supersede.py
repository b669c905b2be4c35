"""Supersede modes (issue 15 §4): the plan, the verdict and the bad input. Pure logic."""

from __future__ import annotations

from typing import Any

import pytest

from celery_baton import ConfigError
from celery_baton.config import Settings
from celery_baton.core.conditions import NotSuperseded, PublishOrder, TakeLease
from celery_baton.core.gate import Decision, parse_decision
from celery_baton.core.keys import KeyNames
from celery_baton.core.policy.compile import compile_policy
from celery_baton.core.policy.model import RunPlan, TaskPolicy
from celery_baton.core.policy.per_call import for_call, parse
from celery_baton.core.policy.plan import plan_delivery
from celery_baton.worker.replacing import keep_order
from celery_baton.worker.verdict import REVOKE_AGAIN, Reason, Skip, Start, Wait, verdict

NAMES = KeyNames("baton")


def feed(feed_url: str, n: int = 0) -> None: ...


def policy_of(**options: Any) -> TaskPolicy:
    policy = compile_policy("t.feed", options.get, feed, Settings())
    assert policy is not None
    return policy


def plan_of(order: int | None = None, **options: Any) -> RunPlan:
    return plan_delivery(
        policy_of(**options),
        NAMES,
        task_id="id-2",
        owner="id-2|w|1",
        args=("u",),
        kwargs={},
        order=order,
    )


def decide(decision: Decision, plan: RunPlan, conflict: str, **kw: Any) -> object:
    return verdict(
        decision, plan, task_name="t.feed", task_id="id-2", conflict=conflict,
        denied_since=kw.get("since"), now=100.0, wait_timeout=kw.get("wait_timeout"),
    )  # fmt: skip


def denied(plan: RunPlan, kind: type, holder: str, retry: float = 30.0) -> Decision:
    condition = next(c for c in plan.conditions if isinstance(c, kind))
    return Decision(False, denied_by=condition, retry_after=retry, holder=holder)


@pytest.mark.parametrize("conflict", ["replace", "keep_last"])
def test_a_superseding_plan_asks_its_publish_order_before_the_lease(conflict: str) -> None:
    plan = plan_of(order=17, exclusive="feed_url", exclusive_conflict=conflict)
    kinds = [type(c) for c in plan.conditions]
    assert kinds == [
        PublishOrder,
        TakeLease,
    ]  # the order first: an older publish never waits for the key
    (order,) = [c for c in plan.conditions if isinstance(c, PublishOrder)]
    assert (order.order, order.task_id) == (17, "id-2")
    assert plan.supersede_key == order.key and order.key.startswith("baton:{t.feed}:sup:")
    # No order in the message: the gate gives one, and the delivery keeps it.
    unstamped = plan_of(exclusive="feed_url", exclusive_conflict=conflict)
    assert unstamped.conditions[0] == PublishOrder(order.key, None, "id-2")
    request = type("R", (), {"request_dict": {}})()
    keep_order(request, unstamped, 99)
    assert unstamped.conditions[0] == PublishOrder(order.key, 99, "id-2")
    assert request.request_dict == {"baton_order": 99}


def test_skip_and_wait_plans_have_no_order() -> None:
    assert [type(c) for c in plan_of(exclusive="feed_url").conditions] == [TakeLease]


def test_a_superseded_delivery_is_skipped_naming_the_newer_task() -> None:
    plan = plan_of(order=1, exclusive="feed_url", exclusive_conflict="keep_last")
    outcome = decide(denied(plan, PublishOrder, "id-9", retry=-1), plan, "keep_last")
    assert isinstance(outcome, Skip) and outcome.reason is Reason.SUPERSEDED
    assert outcome.holder == "id-9" and "superseded by a newer publish, task id-9" in (
        outcome.message
    )


def test_replace_waits_and_asks_to_terminate_the_holder_again_and_again() -> None:
    plan = plan_of(order=5, exclusive="feed_url", exclusive_conflict="replace")
    outcome = decide(denied(plan, TakeLease, "id-1|w|3", retry=25.0), plan, "replace")
    assert isinstance(outcome, Wait) and outcome.reason is Reason.EXCLUSIVE
    assert outcome.revoke == "id-1"
    assert outcome.delay == REVOKE_AGAIN  # asks (and revokes) again if no release comes
    # Its own copy (a redelivery of this very id) is never terminated.
    own = decide(denied(plan, TakeLease, "id-2|w|1"), plan, "replace")
    assert isinstance(own, Wait) and own.revoke == ""


def test_keep_last_waits_without_terminating_and_honours_a_wait_timeout() -> None:
    plan = plan_of(order=5, exclusive="feed_url", exclusive_conflict="keep_last")
    outcome = decide(denied(plan, TakeLease, "id-1|w|3", retry=25.0), plan, "keep_last")
    assert isinstance(outcome, Wait) and outcome.revoke == "" and outcome.delay == 25.0
    late = decide(
        denied(plan, TakeLease, "id-1|w|3"), plan, "keep_last", since=80.0, wait_timeout=5
    )
    assert isinstance(late, Skip) and late.reason is Reason.EXCLUSIVE


def test_granted_replace_starts_with_its_fence() -> None:
    plan = plan_of(order=5, exclusive="feed_url", exclusive_conflict="replace")
    assert decide(Decision(True, fence=8), plan, "replace") == Start(8)


def test_unique_replace_gates_every_run_on_its_marker() -> None:
    policy = policy_of(unique="feed_url", unique_conflict="replace")
    assert policy.gates_runs
    plan = plan_delivery(policy, NAMES, task_id="id-2", owner="id-2|w|1", args=("u",), kwargs={})
    (marker,) = [c for c in plan.conditions if isinstance(c, NotSuperseded)]
    assert marker.key == NAMES.superseded("t.feed", "id-2") == plan.superseded_key
    outcome = decide(denied(plan, NotSuperseded, "id-7", retry=-1), plan, "skip")
    assert isinstance(outcome, Skip) and outcome.reason is Reason.SUPERSEDED
    assert outcome.holder == "id-7"


def test_the_gate_reply_carries_the_order_it_gave() -> None:
    conditions = [PublishOrder("k", None, "id"), TakeLease("l")]
    assert parse_decision(conditions, [1, 3, 0, 0, "e", 42]).seq == 42
    denial = parse_decision(conditions, [0, 2, 1000, "x|w|1", 42])
    assert (denial.seq, denial.denied_by) == (42, conditions[1])
    assert parse_decision(conditions, [0, 2, 1000, "x|w|1"]).seq == 0  # an older reply


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"exclusive": "feed_url", "exclusive_conflict": "replac"}, "did you mean `replace`"),
        ({"exclusive": "feed_url", "exclusive_conflict": "keeplast"}, "did you mean `keep_last`"),
        ({"unique": "feed_url", "unique_conflict": "replase"}, "did you mean `replace`"),
        (
            {"exclusive": "feed_url", "exclusive_conflict": "replace", "exclusive_wait_timeout": 5},
            "exclusive_wait_timeout does nothing",
        ),
        ({"unique_conflict": "replace"}, "unique_conflict needs unique"),
        (
            {"exclusive": "feed_url", "exclusive_conflict": "keep_last", "unique": "feed_url"},
            'de-duplicated before it can supersede.*unique_conflict="replace"',
        ),
    ],
)
def test_bad_supersede_options_raise_at_declaration(options: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        compile_policy("t.feed", options.get, feed, Settings())


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"conflict": "keep-last"}, "did you mean `keep_last`"),
        ({"unique_conflict": "replce"}, "did you mean `replace`"),
        ({"conflict": "replace", "wait_timeout": 3}, "wait_timeout does nothing"),
    ],
)
def test_bad_per_call_supersede_options_raise_at_publish(
    options: dict[str, Any], match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        parse("t.feed", options)


def test_per_call_supersede_modes_override_the_task() -> None:
    call = parse("t.feed", {"conflict": "replace", "unique_conflict": "replace"})
    policy = for_call(policy_of(exclusive="feed_url", unique="feed_url"), call)
    assert policy.supersedes and policy.unique_conflict == "replace"


def test_replace_with_unique_on_the_same_key_needs_unique_replace() -> None:
    both = {"exclusive": "feed_url", "unique": "feed_url", "exclusive_conflict": "replace"}
    assert policy_of(**both, unique_conflict="replace").supersedes
    assert policy_of(**both, unique_until="started").supersedes
    assert policy_of(**{**both, "unique": ["feed_url", "n"]}).supersedes  # another key


def test_a_typo_in_a_supersede_mode_is_refused_when_the_task_is_declared() -> None:
    from celery import Celery

    from celery_baton import Baton

    app = Celery("supersede-declare", broker="memory://", set_as_current=False)
    Baton(app, url="redis://127.0.0.1:1/0")  # declaring never connects
    try:
        with pytest.raises(ConfigError, match="did you mean `keep_last`"):

            @app.task(exclusive="feed_url", exclusive_conflict="keep-last")
            def feed(feed_url: str) -> None: ...

        # Its own name only: app.tasks also holds every shared task another test of
        # this process declared (Celery's @app.task is shared by default).
        assert f"{__name__}.feed" not in app.tasks
    finally:
        app.close()
