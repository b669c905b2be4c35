"""ordered=: its declaration, its plan, what the gate and the release are told, and the
verdict on the gate's answer; without a worker or a store (issue 38 §1)."""

from __future__ import annotations

import datetime

import pytest

from celery_baton.config import Settings, read_settings
from celery_baton.core.conditions import InOrder, TakeLease, encode
from celery_baton.core.gate import Decision, Release, parse_decision
from celery_baton.core.keys import KeyNames
from celery_baton.core.ordered import Note, Place, Turn, positions
from celery_baton.core.policy.compile import compile_policy
from celery_baton.core.policy.model import RunPlan, TaskPolicy
from celery_baton.core.policy.plan import plan_delivery
from celery_baton.errors import ConfigError
from celery_baton.worker import ordering
from celery_baton.worker.verdict import Reason, Skip, Wait, verdict

NAMES = KeyNames("baton")


def apply_event(account_id: int, event: str) -> None: ...


def policy_of(**options: object) -> TaskPolicy:
    policy = compile_policy("bank.apply_event", options.get, apply_event, Settings())
    assert policy is not None
    return policy


def plan_of(place: str = "1700:7", **options: object) -> RunPlan:
    policy = policy_of(ordered="account_id", **options)
    return plan_delivery(
        policy,
        NAMES,
        task_id="id-7",
        owner="id-7|w|1",
        args=(42, "deposit"),
        kwargs={},
        place=place,
    )


# -- declaration ---------------------------------------------------------------------


def test_ordered_holds_its_key_one_at_a_time_and_waits_for_a_held_lease() -> None:
    policy = policy_of(ordered="account_id")
    assert policy.ordered is not None and policy.exclusive is None
    assert policy.exclusive_conflict == "wait" and policy.gates_runs
    assert policy.ordered_gap == 60.0
    assert policy_of(ordered="account_id", ordered_gap_timeout=5).ordered_gap == 5.0
    assert policy_of(ordered=True).ordered is not None  # one line per task


def test_the_gap_bound_is_a_setting_with_a_default_of_a_minute() -> None:
    assert Settings().ordered_gap_timeout == 60.0
    assert read_settings({"baton_ordered_gap_timeout": 5}).ordered_gap_timeout == 5.0
    with pytest.raises(ConfigError, match="baton_ordered_gap_timeout"):
        read_settings({"baton_ordered_gap_timeout": 0})


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"exclusive": "event"}, "exclusive= on another key"),
        ({"exclusive_conflict": "wait"}, "exclusive_conflict cannot be used with ordered="),
        ({"exclusive_wait_timeout": 3}, "exclusive_wait_timeout cannot be used"),
        ({"debounce": 1.0}, "debounce cannot be used with ordered="),
        ({"throttle": 1.0}, "throttle cannot be used with ordered="),
        ({"unique": "event", "unique_conflict": "replace"}, "a replaced call never runs"),
        ({"ordered_gap_timeout": -1}, "ordered_gap_timeout"),
    ],
)
def test_what_cannot_work_beside_ordered_is_refused_at_declaration(
    options: dict[str, object], says: str
) -> None:
    with pytest.raises(ConfigError, match=says) as raised:
        policy_of(ordered="account_id", **options)
    assert "bank.apply_event" in str(raised.value)


def test_exclusive_on_the_same_key_is_the_ordered_key_itself() -> None:
    policy = policy_of(ordered="account_id", exclusive="account_id")
    assert policy.exclusive is None and policy.ordered is not None


def test_ordered_on_a_missing_argument_is_refused_at_declaration() -> None:
    with pytest.raises(ConfigError, match="account"):
        policy_of(ordered="account")


def test_the_gap_bound_needs_ordered() -> None:
    with pytest.raises(ConfigError, match="ordered_gap_timeout needs ordered"):
        policy_of(ordered_gap_timeout=5, exclusive="account_id")


# -- plan, gate and release ---------------------------------------------------------------


def test_the_turn_comes_right_before_the_keys_fenced_lease() -> None:
    plan = plan_of()
    turn, lease = plan.conditions
    assert isinstance(turn, InOrder) and isinstance(lease, TakeLease)
    assert lease.fence and lease.key == plan.exclusive_key
    assert turn.key == plan.order_key == NAMES.ordered("bank.apply_event", turn.key[-24:])
    assert encode(turn) == ("Q", "1700:7", f"60000 {7 * 86400 * 1000}")
    # One Redis Cluster slot: the record and the lease share the task's hash tag.
    assert turn.key.split("}")[0] == lease.key.split("}")[0]


def test_a_final_end_advances_the_line_and_a_retry_keeps_its_place() -> None:
    plan = plan_of()
    base = Release((plan.exclusive_key or "",), plan.owner)

    final = ordering.with_end(base, object(), plan, final=True)
    keys, args = final.script_call("baton:released")
    assert keys == [plan.exclusive_key, plan.order_key]
    assert args[8:] == ["1700 7 1 0", plan.exclusive_key]
    assert args[6:8] == ["", ""]  # the optional ARGV between are padded

    class Retried:
        __dict__ = {ordering.RETRY_IN_ATTR: 2.5}

    kept = ordering.with_end(base, Retried(), plan, final=False)
    assert kept.order == "1700 7 0 2500"


def test_a_call_without_a_place_is_not_an_ordered_end() -> None:
    plan = plan_of(place="")
    base = Release((), plan.owner)
    assert ordering.with_end(base, object(), plan, final=True) is base
    assert ordering.end_place(plan) == ""
    assert ordering.end_place(plan_of()) == "1700 7"


def test_the_gates_note_is_parsed_from_either_reply() -> None:
    plan = plan_of()
    granted = parse_decision(plan.conditions, [1, 5, 0, 10, "e", 0, "skip 3-5"])
    assert granted.granted and Note.parse(granted.note).skipped == (3, 5)
    denied = parse_decision(plan.conditions, [0, 1, -1, "gap 9", 0, ""])
    assert denied.denied_by == plan.conditions[0] and Turn.parse(denied.holder) == Turn("gap", 9)
    assert Note.parse("assigned 1700:12").assigned == Place("1700", 12)
    assert Note.parse("lost").lost and Note.parse("") == Note()
    assert positions((4, 4)) == "4" and positions((4, 6)) == "4-6"


@pytest.mark.parametrize("value", [None, 7, "7", "a:7", "1700:", "1700:7:1"])
def test_an_unreadable_place_is_none(value: object) -> None:
    assert Place.parse(value) is None


def test_a_retrys_countdown_or_eta_is_when_it_is_due() -> None:
    class Retry:
        def __init__(self, when: object) -> None:
            self.when = when

    assert ordering.retry_in(Retry(3)) == 3.0
    soon = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=10)
    assert 8 < ordering.retry_in(Retry(soon)) <= 10
    assert ordering.retry_in(Retry(None)) == 0.0 and ordering.retry_in(None) == 0.0


# -- the verdict ----------------------------------------------------------------------


def judge(decision: Decision, plan: RunPlan) -> object:
    return verdict(
        decision,
        plan,
        task_name="bank.apply_event",
        task_id="id-7",
        conflict="wait",
        denied_since=None,
        now=100.0,
    )


def test_a_later_position_waits_on_the_keys_lease_for_the_release_that_advances() -> None:
    plan = plan_of()
    outcome = judge(
        Decision(False, denied_by=plan.conditions[0], retry_after=4.0, holder="wait 5"), plan
    )
    assert isinstance(outcome, Wait)
    assert outcome.reason is Reason.ORDER and outcome.key == plan.exclusive_key
    assert outcome.delay == 4.0


def test_a_position_the_gap_bound_skipped_is_refused_not_run_out_of_order() -> None:
    plan = plan_of()
    outcome = judge(
        Decision(False, denied_by=plan.conditions[0], retry_after=-1, holder="gap 9"), plan
    )
    assert isinstance(outcome, Skip) and outcome.reason is Reason.OUT_OF_ORDER
    assert "position 7" in outcome.message and "came after its successors ran" in outcome.message
    assert '{"account_id":42}' in outcome.message


def test_a_copy_of_a_call_that_ran_is_skipped_as_already_run() -> None:
    plan = plan_of()
    outcome = judge(
        Decision(False, denied_by=plan.conditions[0], retry_after=-1, holder="ran 9"), plan
    )
    assert isinstance(outcome, Skip) and outcome.reason is Reason.ALREADY_RUN
    assert "has run already (the next is 9)" in outcome.message


def test_a_held_lease_after_the_turn_came_waits_whatever_the_default_conflict() -> None:
    plan = plan_of()
    lease = plan.conditions[1]
    outcome = judge(Decision(False, denied_by=lease, retry_after=1.0, holder="other|w|1"), plan)
    assert isinstance(outcome, Wait) and outcome.reason is Reason.EXCLUSIVE


def test_an_ordered_waiter_ranks_by_its_position() -> None:
    class Request:
        def __init__(self, headers: dict[str, object]) -> None:
            self.request_dict = headers

    assert ordering.rank(Request({"baton_ordered": "1700:3"})) == -3.0
    assert ordering.rank(Request({"baton_ordered": "1700:3"})) > ordering.rank(
        Request({"baton_ordered": "1700:4"})
    )  # type: ignore[operator]
    assert ordering.rank(Request({})) is None


def test_a_call_that_leaves_without_running_gives_up_its_position() -> None:
    plan = plan_of()
    passed = ordering.passed(plan)
    assert passed is not None and passed.lease_keys == ()
    assert passed.order == "1700 7 2 0" and passed.order_key == plan.order_key
    assert ordering.passed(plan_of(place="")) is None


def test_per_call_exclusive_options_are_refused_on_an_ordered_task() -> None:
    from celery_baton.core.policy.per_call import check_against, parse

    policy = policy_of(ordered="account_id")
    for given in ({"exclusive": "x"}, {"conflict": "skip"}):
        with pytest.raises(ConfigError, match="cannot be given to an ordered task"):
            check_against("bank.apply_event", parse("bank.apply_event", given), policy)
    check_against("bank.apply_event", parse("bank.apply_event", {"unique": "u"}), policy)
