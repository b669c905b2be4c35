"""Named limits (``baton_limits``, ``limits=``, ``cost=``): parsing, checks, and plans."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_baton import Baton, ConfigError
from celery_baton.config import Settings
from celery_baton.core.conditions import (
    Override,
    Penalty,
    Rate,
    TakeLease,
    WeightedRate,
    slot_groups,
    spans_slots,
)
from celery_baton.core.keys import KeyNames
from celery_baton.core.policy.compile import compile_policy
from celery_baton.core.policy.plan import plan_delivery
from celery_baton.core.shared_limits import SharedLimit, call_cost, parse_limits
from celery_baton.errors import CostError

NAMES = KeyNames()
LIMITS = {"openai": "90000/m", "db": {"rate": "10/s", "burst": 2}}


def ask(prompt: str, tokens: int) -> None: ...


def compile_(settings: Settings | None = None, **options: Any) -> Any:
    return compile_policy("t.ask", options.get, ask, settings or Settings(limits=LIMITS))


def test_limit_values_and_their_bursts() -> None:
    table = parse_limits({**LIMITS, "slow": 0.5, "fast": "2.5/s"})
    assert table["openai"] == SharedLimit("openai", 1500.0, 90000)  # a minute's tokens
    assert table["db"] == SharedLimit("db", 10.0, 2)
    assert table["slow"].burst == 1 and table["fast"].burst == 2
    assert table["openai"].tolerance_us == 90000 * table["openai"].interval_us


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"x": "ten/s"}, "not a rate"),
        ({"x": {"rate": "1/s", "burts": 3}}, "did you mean `burst`"),
        ({"x": {"concurrency": 5}}, "named limits are rates"),
        ({"x": {"burst": 5}}, 'needs a "rate"'),
        ({"x": {"rate": "1/s", "burst": 0}}, "burst must be an int >= 1"),
        ({"{x}": "1/s"}, "without braces"),
        (["openai"], "expected a mapping"),
    ],
)
def test_bad_limit_values_are_config_errors(value: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_limits(value)


def test_unknown_name_says_did_you_mean() -> None:
    with pytest.raises(ConfigError, match=r"unknown limit 'opneai' \(did you mean `openai`"):
        compile_(limits=["opneai"])
    with pytest.raises(ConfigError, match="the same limit twice"):
        compile_(limits=["db", "db"])
    with pytest.raises(ConfigError, match="cost needs limits"):
        compile_(cost=3)


def test_a_numeric_cost_above_the_burst_is_an_error_at_declaration() -> None:
    with pytest.raises(CostError, match="larger than the burst 2 of limit 'db'"):
        compile_(limits=["openai", "db"], cost=3)
    for bad in (-1, "3", True, float("nan")):
        with pytest.raises(CostError, match="a cost must be"):
            compile_(limits=["db"], cost=bad)
    assert compile_(limits=["db"], cost=2) is not None


def test_a_callable_cost_is_refused_at_run_time_when_too_large() -> None:
    policy = compile_(limits=["openai"], cost=lambda prompt, tokens: tokens)
    plan = plan_delivery(policy, NAMES, task_id="i", owner="i|w|1", args=("p", 500), kwargs={})
    penalty, rate = plan.conditions
    assert penalty == Penalty(NAMES.shared_penalty("openai"))
    limit = parse_limits(LIMITS)["openai"]
    assert rate == WeightedRate(
        NAMES.shared_rate("openai"), 500 * limit.interval_us, limit.tolerance_us
    )
    with pytest.raises(CostError, match="larger than the burst 90000"):
        plan_delivery(policy, NAMES, task_id="i", owner="i|w|1", args=("p", 90001), kwargs={})
    with pytest.raises(CostError, match="the cost callable failed"):
        plan_delivery(policy, NAMES, task_id="i", owner="i|w|1", args=("p",), kwargs={})


def test_call_cost_defaults_to_one() -> None:
    limit = SharedLimit("x", 1.0, 5)
    assert call_cost(None, [limit], (), {}) == 1.0
    assert call_cost(lambda n: n * 2, [limit], (2,), {}) == 4.0


def test_a_task_with_its_own_keys_and_named_limits_spans_two_slots() -> None:
    """On Cluster the named limits' group is asked first, the task's own keys last."""
    policy = compile_(limits=["openai", "db"], exclusive="prompt", cost=1)
    plan = plan_delivery(policy, NAMES, task_id="i", owner="i|w|1", args=("p", 1), kwargs={})
    assert spans_slots(plan.conditions)
    groups = slot_groups(plan.conditions)
    assert [g[0].key.split("}")[0] for g in groups] == [
        "baton:{limit:db",
        "baton:{limit:openai",
        "baton:{t.ask",
    ]
    assert [type(c) for c in groups[-1]] == [TakeLease]
    rated = compile_(limits=["db"], global_rate_limit="5/s")
    plan = plan_delivery(rated, NAMES, task_id="i", owner="i|w|1", args=("p", 1), kwargs={})
    shared, own = slot_groups(plan.conditions)
    assert [type(c) for c in shared] == [Penalty, WeightedRate]
    assert [type(c) for c in own] == [Override, Rate]  # an override stays with its condition
    only_shared = compile_(limits=["openai"])
    plan = plan_delivery(only_shared, NAMES, task_id="i", owner="i|w|1", args=("p", 1), kwargs={})
    assert not spans_slots(plan.conditions)


def test_limits_not_known_at_declaration_are_checked_at_worker_start() -> None:
    assert compile_(Settings(), limits=["anything"]) is None  # conf not read yet: later
    with pytest.raises(ConfigError, match="none declared"):
        compile_(Settings(limits={}), limits=["openai"])


@pytest.fixture
def app() -> Iterator[Celery]:
    celery = Celery("limits-test", broker="memory://", set_as_current=False)
    celery.conf.baton_limits = LIMITS
    Baton(celery, url="redis://127.0.0.1:1/0")
    yield celery
    celery.close()


def test_declaring_a_task_with_an_unknown_limit_fails_at_once(app: Celery) -> None:
    with pytest.raises(ConfigError, match="did you mean `openai`"):

        @app.task(limits=["openia"])
        def summarize(text: str) -> None: ...

    with pytest.raises(ConfigError, match="did you mean `cost`"):

        @app.task(limits=["openai"], cots=3)
        def embed(text: str) -> None: ...


def test_baton_limit_unknown_name_and_bad_cost(app: Celery) -> None:
    from celery_baton.baton import baton_for

    baton = baton_for(app)
    assert baton is not None
    with pytest.raises(ConfigError, match="did you mean `db`"):
        baton.limit("dbs")
    with pytest.raises(CostError, match="larger than the burst 2"):
        baton.limit("db", cost=5)
