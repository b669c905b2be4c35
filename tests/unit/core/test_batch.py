"""Batching's pure logic: declarations refused early, and what a body's return value
means for each call (issue 37). No server: the store is never connected."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from celery_baton import BatchResultError, Baton, Call, ConfigError, CostError, KeySpecError
from celery_baton.core.batch import batch_keys, fit_batch, outcomes
from celery_baton.core.keys import KeyNames
from celery_baton.worker.batching import tick_interval


@pytest.fixture
def app() -> Celery:
    app = Celery("batching", set_as_current=False)
    Baton(app, url="redis://127.0.0.1:1/0")  # never connected by these tests
    return app


def declare(app: Celery, **options: Any) -> Any:
    @app.task(shared=False, **options)
    def index_docs(calls: list[Call]) -> list[int]:
        return [0 for _ in calls]

    return index_docs


def test_a_batched_task_declares_with_its_key_size_and_wait(app: Celery) -> None:
    task = declare(app, batch="account_id", batch_size=50, batch_wait=0.5)
    policy = app.tasks[task.name]
    from celery_baton.baton import baton_for

    baton = baton_for(app)
    assert baton is not None
    batch = baton.policy_for(policy).batch
    assert (batch.size, batch.wait) == (50, 0.5)
    assert batch.key.material((), {"account_id": 7, "doc_id": 1}) == '{"account_id":7}'


def test_the_defaults_are_100_calls_or_1_second(app: Celery) -> None:
    from celery_baton.baton import baton_for

    task = declare(app, batch=True)
    baton = baton_for(app)
    assert baton is not None
    batch = baton.policy_for(task).batch
    assert (batch.size, batch.wait) == (100, 1.0)
    assert batch.key.material((1,), {"x": 2}) == ""  # one stream for the task


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"batch_size": 0}, r"batch_size: must be an int >= 1, got 0"),
        ({"batch_size": 2.5}, r"batch_size: must be an int >= 1"),
        ({"batch_size": True}, r"batch_size: must be an int >= 1"),
        ({"batch_wait": 0}, r"batch_wait: must be a number of seconds > 0"),
        ({"batch_wait": float("inf")}, r"batch_wait: must be a number of seconds > 0 and finite"),
        ({"batch_wait": "1s"}, r"batch_wait: must be a number of seconds"),
        ({"exclusive": "account_id"}, r"batch with exclusive"),
        ({"unique": "account_id"}, r"batch with unique"),
        ({"debounce": 1.0}, r"batch with debounce"),
        ({"ordered": "account_id"}, r"batch cannot be used with ordered=: not yet"),
    ],
)
def test_bad_batch_options_are_refused_at_declaration(
    app: Celery, options: dict[str, Any], match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        declare(app, batch="account_id", **options)


def test_a_batch_may_have_a_global_rate_limit_and_a_global_concurrency(app: Celery) -> None:
    """A batch run is one start of the rate and one slot of the limit (tested on real
    workers in tests/batching/test_batch_limits.py)."""
    declare(app, batch="account_id", global_rate_limit="10/s", global_concurrency=2)


def test_a_batchs_other_keys_name_a_calls_arguments_not_the_bodys(app: Celery) -> None:
    """A per-key limit's key is read from a call's arguments, as the batch key is (the
    body takes only ``calls``)."""
    declare(
        app,
        batch="account_id",
        global_concurrency=2,
        global_concurrency_key="account_id",
        global_rate_limit="10/s",
        global_rate_limit_key="region",
    )


@pytest.mark.parametrize(
    ("batch", "fair_key"),
    [
        ("tenant", "tenant"),
        (["tenant", "account_id"], "tenant"),
        (["tenant", "account_id"], ["account_id", "tenant"]),
        ("{tenant}/{account_id}", "{tenant}"),
        (["tenant", "user"], "{user.org}"),  # an attribute of a batch key's argument
    ],
)
def test_a_fair_key_within_the_batch_key_is_allowed(app: Celery, batch: Any, fair_key: Any) -> None:
    """Every call of a batch then has one fair key: a batch run is one admission of the
    fair-shared limit under it (on real workers: tests/batching/test_batch_limits.py)."""
    from celery_baton.baton import baton_for

    task = declare(app, batch=batch, fair_key=fair_key, global_concurrency=2)
    baton = baton_for(app)
    assert baton is not None
    policy = baton.policy_for(task)
    assert policy.batch is not None and policy.fair is not None


@pytest.mark.parametrize(
    ("batch", "fair_key", "match"),
    [
        (
            "account_id",
            "tenant",
            r"index_docs.fair_key: batch with fair_key: fair_key reads 'tenant', which the "
            r"batch key 'account_id' does not.*batch=\['account_id', 'tenant'\]",
        ),
        (
            ["account_id", "region"],
            "{tenant}-{region}",
            r"fair_key reads 'tenant', which the batch key \['account_id', 'region'\] does not",
        ),
        ("{account_id}", ["tenant", "plan"], r"fair_key reads 'tenant', 'plan'"),
        (True, "tenant", r"batch=True with fair_key: batch=True makes one batch of every"),
        (lambda tenant, **kw: tenant, "tenant", r"the batch key is a callable"),
        ("tenant", lambda tenant, **kw: tenant, r"a callable fair_key reads arguments"),
    ],
)
def test_a_fair_key_a_batch_would_mix_is_refused_naming_what_is_missing(
    app: Celery, batch: Any, fair_key: Any, match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        declare(app, batch=batch, fair_key=fair_key, global_rate_limit="10/s")


def test_a_batch_with_fair_key_still_needs_a_limit_to_share(app: Celery) -> None:
    with pytest.raises(ConfigError, match="fair_key shares a limit fairly: it needs"):
        declare(app, batch="tenant", fair_key="tenant")
    with pytest.raises(ConfigError, match="fair_key must name what the limit is shared by"):
        declare(app, batch="tenant", fair_key=True, global_concurrency=1)


def test_a_batch_may_spend_named_limits_per_run_or_by_its_calls() -> None:
    """A batch run is one admission of each named limit: ``cost=`` a number per run, or
    a callable of the batch's calls (tested on real workers in test_batch_limits.py)."""
    app = Celery("batching", set_as_current=False)
    app.conf.baton_limits = {"partner": {"rate": "10/s", "burst": 5}}
    Baton(app, url="redis://127.0.0.1:1/0")
    declare(app, batch="account_id", batch_size=50, limits=["partner"])
    declare(app, batch="account_id", batch_size=50, limits=["partner"], cost=3)
    declare(app, batch="account_id", batch_size=5, limits=["partner"], cost=len)
    declare(app, batch="account_id", batch_size=50, limits="partner", cost=lambda calls: 1)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        # A full batch could never be admitted: refused, not a key that never runs.
        (
            {"batch_size": 6, "cost": len},
            r"cost: cost=len: a full batch of 6 calls costs 6, more than the burst 5 of "
            r"limit 'partner'.*batch_size <= 5",
        ),
        # Written for one call: a batch's cost gets the list of calls.
        (
            {"cost": lambda account_id, doc_id: 1},
            r"cost: a batched task's cost= gets the batch's list of calls.*account_id, doc_id",
        ),
        ({"cost": 6}, r"cost 6 is larger than the burst 5 of limit 'partner'"),
    ],
)
def test_a_batch_cost_that_cannot_work_is_refused_at_declaration(
    options: dict[str, Any], match: str
) -> None:
    app = Celery("batching", set_as_current=False)
    app.conf.baton_limits = {"partner": {"rate": "10/s", "burst": 5}}
    Baton(app, url="redis://127.0.0.1:1/0")
    with pytest.raises(ConfigError, match=match):
        declare(app, batch="account_id", limits=["partner"], **options)


def _weights(limit: int) -> Any:
    def price(calls: list[int]) -> float:
        if sum(calls) > limit:
            raise CostError(f"{sum(calls)} > {limit}")
        return float(sum(calls))

    return price


def test_a_batch_that_costs_too_much_keeps_its_carrier_and_the_oldest_that_fit() -> None:
    assert fit_batch([1, 1, 1], 2, _weights(5)) == ([1, 1, 1], 3.0)  # all fit
    # The carrier (index 3) and the oldest others that fit, in their order.
    assert fit_batch([2, 2, 2, 3], 3, _weights(5)) == ([2, 3], 5.0)
    assert fit_batch([1, 1, 1, 1, 1, 1, 1], 0, _weights(4)) == ([1, 1, 1, 1], 4.0)
    # Oldest first: one that never fits keeps the younger from joining (its holder
    # refuses it when it carries a batch).
    assert fit_batch([9, 1, 1], 1, _weights(4)) == ([1], 1.0)
    with pytest.raises(CostError):  # the carrier alone never fits
        fit_batch([1, 9], 1, _weights(4))
    with pytest.raises(CostError):
        fit_batch([9], 0, _weights(4))


def test_batch_size_or_wait_without_batch_is_refused(app: Celery) -> None:
    with pytest.raises(ConfigError, match="batch_size needs batch"):
        declare(app, batch_size=10)
    with pytest.raises(ConfigError, match="batch_wait needs batch"):
        declare(app, batch_wait=1.0)


def test_a_body_written_for_one_call_is_refused(app: Celery) -> None:
    with pytest.raises(ConfigError, match=r"takes one argument, the list of calls.*account_id"):

        @app.task(shared=False, batch="account_id")
        def index_docs(account_id: int, doc_id: int) -> None: ...


def test_a_bound_body_takes_self_and_the_calls(app: Celery) -> None:
    @app.task(shared=False, bind=True, batch="account_id")
    def index_docs(self: Any, calls: list[Call]) -> list[str]:
        return [f"{self.name}:{c.id}" for c in calls]

    result = index_docs.apply(kwargs={"account_id": 1}, task_id="t-1")
    assert result.get() == f"{index_docs.name}:t-1"


def test_a_bad_key_spec_is_refused(app: Celery) -> None:
    with pytest.raises(KeySpecError):
        declare(app, batch=3)
    with pytest.raises(ConfigError, match="names 'calls'"):
        declare(app, batch="calls")


def test_a_call_run_directly_is_a_batch_of_one_with_its_own_result(app: Celery) -> None:
    @app.task(shared=False, batch="account_id")
    def double(calls: list[Call]) -> list[int]:
        assert len(calls) == 1
        return [c.kwargs["doc"] * 2 for c in calls]

    assert double.apply(kwargs={"account_id": 1, "doc": 4}).get() == 8
    assert double(account_id=1, doc=5) == 10  # Celery's argument check lets a call pass


def test_a_list_gives_each_call_its_result_in_order() -> None:
    calls = [Call("a"), Call("b")]
    assert outcomes(calls, [1, 2]) == [(True, 1), (True, 2)]
    assert outcomes(calls, (1, 2)) == [(True, 1), (True, 2)]


def test_a_mapping_gives_results_by_call_id_and_a_missing_call_fails_naming_it() -> None:
    calls = [Call("a"), Call("b")]
    (first, second) = outcomes(calls, {"a": 1})
    assert first == (True, 1)
    ok, error = second
    assert not ok and isinstance(error, BatchResultError)
    assert error.call_id == "b" and "no result for call b" in str(error)


@pytest.mark.parametrize("returned", [[1], [1, 2, 3], None, 5, "ab"])
def test_a_result_of_another_shape_fails_every_call_clearly(returned: Any) -> None:
    calls = [Call("a"), Call("b")]
    for ok, error in outcomes(calls, returned):
        assert not ok
        assert isinstance(error, BatchResultError)
        assert "one result per call, in order, or a mapping by call id" in str(error)


def test_one_keys_state_shares_one_hash_slot() -> None:
    keys = batch_keys(KeyNames("baton"), "proj.index", "abc")
    assert len(keys) == 11  # pending ... epoch, the label, and here
    assert {k.split("}")[0] for k in keys} == {"baton:{batch:proj.index:abc"}


def test_ticks_come_four_times_per_batch_wait_within_bounds() -> None:
    assert tick_interval([0.2]) == 0.05
    assert tick_interval([0.08, 1.0]) == 0.02
    assert tick_interval([0.001]) == 0.01
    assert tick_interval([]) == 0.05


def test_a_call_without_the_keys_argument_is_refused_at_publish(app: Celery) -> None:
    task = declare(app, batch="account_id")
    with pytest.raises(KeySpecError, match=r"by keyword: index_docs.delay\(account_id=\.\.\., "):
        task.delay(7, doc_id=1)  # by position: refused before anything is sent
    with pytest.raises(KeySpecError, match=r"lacks argument"):
        task.delay(doc_id=1)


def test_a_retry_in_a_batched_body_called_eagerly_retries_as_celery_does(app: Celery) -> None:
    """A batch of one (``.apply()``): Celery's eager retry runs it again at once."""
    attempts: list[int] = []

    @app.task(shared=False, bind=True, batch="account_id", max_retries=2)
    def flaky(self: Any, calls: list[Call]) -> list[int]:
        attempts.append(self.request.retries)
        if len(attempts) < 2:
            raise self.retry(countdown=1)
        return [len(attempts) for _ in calls]

    assert flaky.apply(kwargs={"account_id": 1}).get() == 2
    assert attempts == [0, 1]


def test_a_batched_task_declared_by_a_call_of_app_task_takes_a_calls_arguments(
    app: Celery,
) -> None:
    def double(calls: list[Call]) -> list[int]:
        return [c.kwargs["doc"] * 2 for c in calls]

    task = app.task(double, shared=False, batch="account_id")
    assert task.apply(kwargs={"account_id": 1, "doc": 4}).get() == 8


def test_a_retry_is_a_delivery_of_its_own_under_its_task_id() -> None:
    """Celery publishes a retry under the same task id; the store tells it from the call
    that already ran by its retry count."""
    from celery_baton.core.batch import delivery_id, task_id_of

    assert delivery_id("abc", 0) == "abc"
    assert delivery_id("abc", 2) == "abc~2"
    assert delivery_id("abc", 2) != delivery_id("abc", 1)
    assert task_id_of(delivery_id("abc", 2)) == task_id_of("abc") == "abc"
