"""Task options compiled into a policy: validation at declaration, and each run's plan."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_baton import Baton, ConfigError, KeySpecError
from celery_baton.config import Settings
from celery_baton.core.conditions import (
    ClaimUnique,
    FreeUnique,
    KeepUnique,
    Override,
    Rate,
    TakeLease,
    encode,
)
from celery_baton.core.keys import KeyNames, digest
from celery_baton.core.policy.compile import compile_policy
from celery_baton.core.policy.options import declares_options
from celery_baton.core.policy.plan import plan_delivery
from celery_baton.errors import RateSpecError

NAMES = KeyNames()


def feed(feed_url: str, page: int = 1) -> None: ...


def compile_(fun: Any = feed, settings: Settings | None = None, **options: Any) -> Any:
    return compile_policy("app.feed", options.get, fun, settings or Settings())


@pytest.fixture
def app() -> Iterator[Celery]:
    # memory:// and no backend: declaring tasks never connects anywhere.
    celery = Celery("policy-test", broker="memory://", set_as_current=False)
    Baton(celery, url="redis://127.0.0.1:1/0")
    yield celery
    celery.close()


def test_no_options_no_policy() -> None:
    assert compile_() is None
    assert compile_(exclusive=False) is None
    assert not declares_options({"bind": True, "acks_late": True})
    assert declares_options({"unique": "x"})


def test_global_rate_limits_give_every_task_a_runtime_rate() -> None:
    """`celery control rate_limit` may give any task a rate at runtime: with
    ``baton_global_rate_limits`` every task's policy reads it, and a task with nothing
    else plans no condition while it has none (it never reaches the gate)."""
    settings = Settings(global_rate_limits=True)
    bare = compile_(settings=settings)
    assert bare.rate_from_celery and bare.celery_rate_only
    plan = plan_delivery(bare, NAMES, task_id="t", owner="o", args=(), kwargs={})
    assert plan.conditions == [] and plan.unique_key is None
    limited = plan_delivery(
        bare, NAMES, task_id="t", owner="o", args=(), kwargs={}, celery_rate=0.1
    )
    assert [type(c) for c in limited.conditions] == [Override, Rate]
    guarded = compile_(settings=settings, exclusive="feed_url")
    assert guarded.rate_from_celery and not guarded.celery_rate_only
    declared = compile_(settings=settings, global_rate_limit="2/s")
    assert not declared.rate_from_celery  # the declared global rate wins


@pytest.mark.parametrize("rate_limit", ["5/sec", "10/min", "5 / s", "abc", "2/d"])
def test_a_task_rate_limit_celery_cannot_read_is_refused_at_its_declaration(
    rate_limit: str,
) -> None:
    """Under ``baton_global_rate_limits`` a task's own ``rate_limit`` is read by Celery's
    worker too, at its start, where anything but 'N/s', 'N/m', 'N/h' or a number failed
    with a KeyError naming no task: refused at the declaration, naming it."""
    settings = Settings(global_rate_limits=True)
    with pytest.raises(RateSpecError, match="not a rate Celery reads") as caught:
        compile_(settings=settings, rate_limit=rate_limit)
    assert "rate_limit" in str(caught.value)
    for celerys in ("5/s", "10/m", "100/h", "7", "0.5/s"):
        assert compile_(settings=settings, rate_limit=celerys) is not None


def test_defaults() -> None:
    policy = compile_(exclusive="feed_url")
    assert policy.exclusive_conflict == "skip"
    assert policy.lease_ttl == 8
    assert policy.unique is None and policy.gates_runs
    custom = compile_(exclusive=True, settings=Settings(lease_ttl=7))
    assert custom.lease_ttl == 7
    assert compile_(exclusive=True, lease_ttl=2.5).lease_ttl == 2.5


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"exclusive": "feed_url", "exclusive_conflict": "queue"}, "exclusive_conflict"),
        ({"unique": "feed_url", "unique_until": "acked"}, "unique_until"),
        ({"exclusive": True, "lease_ttl": 0}, "lease_ttl"),
        ({"exclusive": True, "lease_ttl": -1}, "lease_ttl"),
        ({"exclusive": True, "lease_ttl": True}, "lease_ttl"),
        ({"exclusive": True, "lease_ttl": "30"}, "lease_ttl"),
        ({"unique": True, "unique_ttl": 0}, "unique_ttl"),
        ({"global_concurrency": 0}, "global_concurrency"),
        ({"global_concurrency_key": "feed_url"}, "needs global_concurrency"),
    ],
)
def test_invalid_options_raise_config_error(options: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match) as error:
        compile_(**options)
    assert "app.feed" in str(error.value)


def test_exclusive_plan_asks_for_one_fenced_lease() -> None:
    policy = compile_(exclusive="feed_url", lease_ttl=5)
    plan = plan_delivery(policy, NAMES, task_id="id-1", owner="id-1|w|n", args=("u",), kwargs={})
    material = '{"feed_url":"u"}'
    key = "baton:{app.feed}:ex:" + digest(material)
    assert plan.exclusive_key == key
    assert plan.conditions == [TakeLease(key, limit=1, fence=True)]
    assert [(x.key, x.owner, x.limit, x.ttl) for x in plan.leases] == [(key, "id-1|w|n", 1, 5)]
    assert plan.labels[key] == material
    assert plan.unique_key is None and plan.done_key is None
    same = plan_delivery(
        policy, NAMES, task_id="id-2", owner="o", args=(), kwargs={"feed_url": "u"}
    )
    assert same.exclusive_key == key


def test_unique_until_finished_needs_no_gate_and_started_frees_at_the_gate() -> None:
    finished = compile_(unique="feed_url")
    assert finished is not None and not finished.gates_runs
    plan = plan_delivery(finished, NAMES, task_id="id-1", owner="o", args=("u",), kwargs={})
    assert plan.conditions == [] and plan.unique_key and ":uq:" in plan.unique_key

    started = compile_(unique="feed_url", unique_until="started")
    assert started.gates_runs
    plan = plan_delivery(started, NAMES, task_id="id-1", owner="o", args=("u",), kwargs={})
    assert plan.conditions == [FreeUnique(plan.unique_key, "id-1")]


def test_a_run_keeps_its_unique_claim_when_it_may_be_short_or_the_gate_is_asked_anyway() -> None:
    """The claim's ttl may be a message's ``expires``: the run holds it while it lives
    (lease_ttl, renewed, or until the expiry if later: a copy given back before then may
    still run), in a gate call made for it; without expires, for unique_ttl in the gate
    call the task makes anyway."""
    only = compile_(unique="feed_url", unique_ttl=60, lease_ttl=5)
    plan = plan_delivery(
        only, NAMES, task_id="id-1", owner="o", args=("u",), kwargs={}, expires_at=102.0, now=100.0
    )
    assert plan.conditions == [KeepUnique(plan.unique_key, "id-1", 5)]
    assert plan.kept_claim is not None and plan.kept_claim.ttl_from(100.0) == 5
    assert plan.kept_claim.ttl_from(90.0) == 12  # the expiry is further: held until then
    assert encode(KeepUnique("k", "id-1", 60)) == ("K", "id-1", "60000")

    gated = compile_(unique="feed_url", global_concurrency=2)
    plan = plan_delivery(gated, NAMES, task_id="id-1", owner="o", args=("u",), kwargs={})
    assert plan.conditions[-1] == KeepUnique(plan.unique_key, "id-1", 3600)

    started = compile_(unique="feed_url", unique_until="started")
    plan = plan_delivery(
        started, NAMES, task_id="id-1", owner="o", args=("u",), kwargs={}, expires_at=1.0
    )
    assert plan.conditions == [FreeUnique(plan.unique_key, "id-1")]


def test_plan_with_bad_arguments_raises_key_spec_error() -> None:
    policy = compile_(exclusive="feed_url")
    with pytest.raises(KeySpecError):
        plan_delivery(policy, NAMES, task_id="i", owner="o", args=(object(),), kwargs={})
    with pytest.raises(KeySpecError):
        plan_delivery(policy, NAMES, task_id="i", owner="o", args=(1, 2, 3), kwargs={})


# -- declaration through Baton's @app.task: errors now, not at 3 a.m. ----------------------


@pytest.mark.parametrize(
    "options",
    [
        {"exclusive": "missing"},
        {"unique": "missing"},
        {"exclusive": ["feed_url", "missing"]},
        {"unique": "{missing}"},
        {"global_concurrency": 2, "global_concurrency_key": "missing"},
        {"global_rate_limit": "1/s", "global_rate_limit_key": "missing"},
    ],
)
def test_a_key_spec_naming_a_missing_argument_raises_at_declaration(
    app: Celery, options: dict[str, Any]
) -> None:
    with pytest.raises(KeySpecError, match="missing"):

        @app.task(**options)
        def feed(feed_url: str) -> None: ...

    # (Only this module's: Celery adds every shared task declared anywhere in the process
    # to each app it finalizes, e.g. another test app's own ``feed``.)
    assert f"{__name__}.feed" not in app.tasks


def test_bad_option_values_raise_at_declaration(app: Celery) -> None:
    with pytest.raises(ConfigError, match="exclusive_conflict"):

        @app.task(exclusive=True, exclusive_conflict="later")
        def feed(feed_url: str) -> None: ...


def test_bound_tasks_validate_against_the_arguments_after_self(app: Celery) -> None:
    @app.task(bind=True, exclusive="feed_url", name="policy.bound")
    def bound(self: Any, feed_url: str) -> None: ...

    assert bound.name == "policy.bound"
    with pytest.raises(KeySpecError, match="self"):

        @app.task(bind=True, exclusive="self", name="policy.bad")
        def bad(self: Any, feed_url: str) -> None: ...


def test_plain_decorator_forms(app: Celery) -> None:
    @app.task
    def plain(x: int) -> int:
        return x

    @app.task(exclusive=True, name="policy.whole")
    def whole(x: int) -> int:
        return x

    assert plain.name.endswith("plain") and whole.name == "policy.whole"
    assert whole.exclusive is True


def test_several_rates_are_conditions_of_one_call() -> None:
    from celery_baton.config import Settings
    from celery_baton.core.keys import KeyNames
    from celery_baton.core.policy.compile import compile_policy

    def fetch(host: str) -> None: ...

    options = {"global_rate_limit": ["10/s", "500/h"], "global_rate_limit_key": "host"}
    policy = compile_policy("t.fetch", options.get, fetch, Settings())
    assert policy is not None and len(policy.more_rates) == 1
    plan = plan_delivery(policy, KeyNames(), task_id="i", owner="i|w|1", args=("h",), kwargs={})
    rates = [c for c in plan.conditions if isinstance(c, Rate)]
    assert len(rates) == 2 and len({c.key for c in rates}) == 2
    assert len({c.key.split(":")[1] for c in rates}) == 1  # one family: one Cluster slot
    for bad in ([], ["10/s", "10/s"], ["10/s", "ten"]):
        with pytest.raises(ConfigError):
            compile_policy("t.fetch", {"global_rate_limit": bad}.get, fetch, Settings())


@pytest.mark.parametrize(
    ("options", "at_publish"),
    [
        ({"unique": "feed_url"}, True),
        ({"ordered": "feed_url"}, True),
        ({"exclusive": "feed_url", "exclusive_conflict": "replace"}, True),
        ({"debounce": 1.0, "debounce_key": "feed_url"}, True),
        ({"exclusive": "feed_url"}, False),
        ({"exclusive": "feed_url", "exclusive_conflict": "wait"}, False),
        ({"global_rate_limit": "10/s"}, False),
        ({"global_concurrency": 2}, False),
        ({"redelivery_guard": True}, False),
    ],
)
def test_keys_at_publish_says_whether_a_publish_builds_a_key(
    options: dict[str, Any], at_publish: bool
) -> None:
    """A publish reads its arguments as a worker would only to build a key of its own;
    the others' keys are built by the worker alone."""
    policy = compile_(**options)
    assert policy is not None and policy.keys_at_publish is at_publish


def test_a_call_published_unclaimed_claims_its_unique_key_in_its_gate_call() -> None:
    """Published where the task's options were unknown, nothing was claimed: the worker
    claims the key (for unique_ttl, or held while the run lives under an expiry) before
    it frees it at the start (``unique_until="started"``); a ``"replace"`` call is not
    ordered there, so it claims nothing."""
    only = compile_(unique="feed_url", unique_ttl=60, lease_ttl=5)
    plan = plan_delivery(
        only, NAMES, task_id="id-1", owner="o", args=("u",), kwargs={}, unclaimed=True
    )
    assert plan.conditions == [ClaimUnique(plan.unique_key or "", "id-1", 60)]
    assert encode(ClaimUnique("k", "id-1", 60)) == ("C", "id-1", "60000")
    plan = plan_delivery(
        only, NAMES, task_id="id-1", owner="o", args=("u",), kwargs={}, unclaimed=True,
        expires_at=102.0, now=100.0,
    )  # fmt: skip
    assert plan.conditions == [ClaimUnique(plan.unique_key or "", "id-1", 5)]
    assert plan.kept_claim is not None

    started = compile_(unique="feed_url", unique_until="started")
    plan = plan_delivery(
        started, NAMES, task_id="id-1", owner="o", args=("u",), kwargs={}, unclaimed=True
    )
    key = plan.unique_key or ""
    assert plan.conditions == [ClaimUnique(key, "id-1", 3600), FreeUnique(key, "id-1")]

    replacing = compile_(unique="feed_url", unique_conflict="replace")
    plan = plan_delivery(
        replacing, NAMES, task_id="id-1", owner="o", args=("u",), kwargs={}, unclaimed=True
    )
    assert not any(isinstance(c, ClaimUnique) for c in plan.conditions)
