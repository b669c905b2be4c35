"""Debounce and throttle options at declaration, their store keys, and the scripts'
replies read back. Pure logic: no server."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_baton import Baton, ConfigError
from celery_baton.config import Settings
from celery_baton.core.debounce import FlowKind, Outcome, parse_decision
from celery_baton.core.keys import KeyNames
from celery_baton.core.policy.compile import compile_policy
from celery_baton.core.policy.plan import plan_delivery

NAMES = KeyNames()


def save(doc_id: str, version: int = 0) -> None: ...


def compile_(**options: Any) -> Any:
    return compile_policy("app.save", options.get, save, Settings())


@pytest.fixture
def app() -> Iterator[Celery]:
    celery = Celery("debounce-test", broker="memory://", set_as_current=False)
    Baton(celery, url="redis://127.0.0.1:1/0")
    yield celery
    celery.close()


def test_debounce_compiles_and_plans_its_key_per_argument() -> None:
    policy = compile_(debounce=5.0, debounce_key="doc_id", debounce_max_wait=60)
    flow = policy.flow
    assert flow.kind is FlowKind.DEBOUNCE and flow.seconds == 5.0 and flow.max_wait == 60.0
    assert policy.gates_runs
    a = plan_delivery(policy, NAMES, task_id="t", owner="o", args=("a",), kwargs={})
    a2 = plan_delivery(
        policy, NAMES, task_id="u", owner="o", args=(), kwargs={"doc_id": "a", "version": 3}
    )
    b = plan_delivery(policy, NAMES, task_id="t", owner="o", args=("b",), kwargs={})
    assert a.flow_key == a2.flow_key != b.flow_key
    assert a.flow_key.startswith("baton:{app.save}:db:")  # the task's hash tag
    assert a.conditions == []  # nothing else to ask the gate for
    # Without a key: one burst for the whole task.
    whole = compile_(debounce=1)
    one = plan_delivery(whole, NAMES, task_id="t", owner="o", args=("a",), kwargs={})
    assert (
        one.flow_key
        == plan_delivery(whole, NAMES, task_id="t", owner="o", args=("b",), kwargs={}).flow_key
    )


def test_throttle_compiles_with_its_mode() -> None:
    flow = compile_(throttle=2, throttle_key="doc_id").flow
    assert flow.kind is FlowKind.THROTTLE and flow.mode == "drop"
    assert compile_(throttle=2, throttle_mode="trailing").flow.mode == "trailing"
    plan = plan_delivery(
        compile_(throttle=2), NAMES, task_id="t", owner="o", args=("a",), kwargs={}
    )
    assert ":th:" in plan.flow_key


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"debounce": -1}, "debounce: must be a number of seconds > 0"),
        ({"debounce": 0}, "must be a number of seconds > 0"),
        ({"debounce": "5"}, "must be a number of seconds > 0"),
        ({"debounce": True}, "must be a number of seconds > 0"),
        ({"debounce": float("inf")}, "must be finite"),
        ({"debounce": 5, "debounce_max_wait": 2}, "must be >= debounce"),
        ({"debounce": 5, "debounce_max_wait": -1}, "seconds > 0"),
        ({"debounce_key": "doc_id"}, "debounce_key needs debounce"),
        ({"debounce_max_wait": 60}, "debounce_max_wait needs debounce"),
        ({"throttle_mode": "drop"}, "throttle_mode needs throttle"),
        ({"throttle": 1, "throttle_mode": "last"}, "must be one of"),
        ({"debounce": 1, "throttle": 1}, "choose one"),
        ({"debounce": 1, "unique": "doc_id"}, "unique with debounce"),
        ({"debounce": 1, "debounce_key": "missing"}, "missing"),
    ],
)
def test_bad_options_are_config_errors(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        compile_(**options)


def test_bad_options_fail_at_declaration_with_a_suggestion(app: Celery) -> None:
    with pytest.raises(ConfigError, match="did you mean `debounce`"):

        @app.task(debounse=5.0)
        def typo(doc_id: str) -> None: ...

    with pytest.raises(ConfigError, match="did you mean `debounce_max_wait`"):

        @app.task(debounce=5.0, debounce_max_wiat=60)
        def typo2(doc_id: str) -> None: ...

    with pytest.raises(ConfigError, match="debounce_max_wait"):

        @app.task(debounce=5.0, debounce_max_wait=1.0)
        def short(doc_id: str) -> None: ...

    with pytest.raises(ConfigError, match="seconds > 0"):

        @app.task(throttle=-1)
        def negative(doc_id: str) -> None: ...


def test_replies_are_read() -> None:
    run = parse_decision([1, b"a", b"b"])
    assert run.outcome is Outcome.RUN and run.stands_for == ("a", "b")
    assert parse_decision([1]).stands_for == ()
    wait = parse_decision([0, 1500])
    assert wait.outcome is Outcome.WAIT and wait.delay == 1.5
    skip = parse_decision([2, "runner"])
    assert skip.outcome is Outcome.SKIP and skip.holder == "runner"


def test_the_store_remembers_a_run_long_enough_for_a_redelivery() -> None:
    assert compile_(debounce=1).flow.retention == 3600.0
    assert compile_(debounce=1, debounce_max_wait=900).flow.retention == 9000.0


def test_a_decision_becomes_a_verdict() -> None:
    from types import SimpleNamespace

    from celery_baton.core.debounce import FlowDecision
    from celery_baton.worker import flow
    from celery_baton.worker.holding import Delivery
    from celery_baton.worker.pool.stand_ins import STANDS_FOR_FIELD
    from celery_baton.worker.verdict import Reason, Skip, Start, Wait

    def delivery(**options: Any) -> Delivery:
        policy = compile_(**options)
        plan = plan_delivery(policy, NAMES, task_id="t", owner="o", args=("a",), kwargs={})
        request = SimpleNamespace(name="app.save", id="t", request_dict={})
        return Delivery(request, policy, plan, 0)

    d = delivery(debounce=1)
    assert flow.outcome(d, FlowDecision(Outcome.RUN, stands_for=("x", "y"))) == Start()
    assert d.plan.flow_passed and d.request.request_dict[STANDS_FOR_FIELD] == ["x", "y"]
    wait = flow.outcome(delivery(debounce=1), FlowDecision(Outcome.WAIT, delay=0.5))
    assert wait == Wait(Reason.DEBOUNCE, d.plan.flow_key, 0.5, jitter=False)
    skip = flow.outcome(delivery(debounce=1), FlowDecision(Outcome.SKIP, holder="new"))
    assert isinstance(skip, Skip) and skip.reason is Reason.COALESCED and skip.holder == "new"
    dropped = flow.outcome(delivery(throttle=1), FlowDecision(Outcome.SKIP, holder="first"))
    assert isinstance(dropped, Skip) and dropped.reason is Reason.THROTTLED
    assert "ran within the 1s window" in dropped.message
    trailing = delivery(throttle=1, throttle_mode="trailing")
    superseded = flow.outcome(trailing, FlowDecision(Outcome.SKIP, holder="newest"))
    assert isinstance(superseded, Skip) and superseded.reason is Reason.COALESCED
