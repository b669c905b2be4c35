"""Every way a run can end leaves its exclusive and unique keys in the right state.

Issue 2, item 5: ``self.retry``, ``autoretry_for``, max retries exceeded, ``Reject``,
``Ignore``, revoke before start and with ``terminate=True``, ``expires``, soft and hard
time limits. After a final outcome the exclusive key has no live owner and the unique key
is free; during a pending retry the unique key stays with the task id; a retry never
deadlocks on its own key (with ``exclusive_conflict`` "skip" and "wait").

One pair of workers serves the whole module (each test uses its own keys), so the
module does not request the per-test fixtures that flush the servers.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import redis

from tests.support.celery_processes import WorkerProcess, app_env
from tests.support.observer import Observer, assert_fences_increase, assert_no_overlap
from tests.support.pools import TIME_LIMIT_POOLS, pool_setting
from tests.support.servers import StoreServer
from tests.support.waiting import wait_until
from tests.support.workers import Workers

APP = "tests.apps.exclusive"


@pytest.fixture(scope="module", params=[*TIME_LIMIT_POOLS, "threads", "solo"])
def pair(
    request: pytest.FixtureRequest,
    store_server: StoreServer,
    broker_server: StoreServer,
    app_environ: None,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[list[WorkerProcess]]:
    """Two workers of one pool: Celery's default; its processes recycled after every
    task (``--max-tasks-per-child 1``: a retry, a waiter and the next call each start in
    a process forked after the last run, and the one a time limit killed is replaced
    too); autoscaled (``--autoscale 3,1``, idle processes terminated between calls);
    gevent, whose time limit unwinds the run's greenlet (the run ends in no state
    Celery names) where prefork kills its process; threads, whose runs end on threads
    of the main process beside its consumer; and solo, whose runs block its consumer."""
    for server in (store_server, broker_server):
        server.resume()
        server.start()
        server.flushall()
    env = app_env(
        store_server.url(0), broker_server.url(0), broker_server.url(1), broker_server.url(2)
    )
    name, extra, pool_env = pool_setting(request.param)
    started = Workers({**env, **pool_env}, tmp_path_factory.mktemp("matrix"))
    try:
        pair = [
            started.start(APP, pool=name, concurrency=3, extra_args=extra, wait=False)
            for _ in range(2)
        ]
        for worker in pair:
            worker.wait_ready()
        yield pair
    finally:
        started.stop_all(timeout=15)


@pytest.fixture(scope="module")
def observer(broker_server: StoreServer, pair: list[WorkerProcess]) -> Iterator[Observer]:
    obs = Observer(broker_server.url(2))
    yield obs
    obs.close()


@pytest.fixture
def pool(request: pytest.FixtureRequest) -> str:
    """The pair's pool (the module's parameter)."""
    return str(request.node.callspec.params["pair"])


#: Celery's gevent pool enforces the hard time limit only: a soft limit is not raised
#: there, and the run ends as it would without one.
NO_SOFT_LIMIT = {"gevent", "threads", "solo"}
#: Nor a hard one on the threads and solo pools: the run ends as without a limit.
NO_HARD_LIMIT = {"threads", "solo"}


@pytest.fixture
def store(store_server: StoreServer, pair: list[WorkerProcess]) -> Iterator[redis.Redis]:
    with store_server.client() as client:
        yield client


@pytest.fixture
def key(request: pytest.FixtureRequest) -> str:
    return f"{request.node.name}-{uuid.uuid4().hex[:8]}"


def starts(observer: Observer, key: str) -> list[dict[str, Any]]:
    return [s for s in observer.started() if s["key"] == key]


def finished(observer: Observer, key: str) -> list[Any]:
    return [r for r in observer.runs() if r.key == key]


class Keys:
    """The exclusive and unique keys of one call, and their state in the store."""

    def __init__(self, store: redis.Redis, task: Any, key: str, n: int = 0) -> None:
        from tests.apps.exclusive import exclusive_key, unique_key

        self.store = store
        self.exclusive = exclusive_key(task, key)
        self.unique = unique_key(task, key, n=n)

    def owners(self) -> dict[str, int]:
        from tests.apps.exclusive import live_owners

        return live_owners(self.store, self.exclusive)

    def unique_holder(self) -> str | None:
        return self.store.get(self.unique)

    def free(self) -> bool:
        return not self.owners() and self.unique_holder() is None

    def assert_settle_free(self) -> None:
        wait_until(self.free, 5, f"{self.exclusive} and {self.unique} freed")


# mode, arg, publish options, attempts that start, runs that finish, final state
CASES = {
    "retry-countdown-0-skip": ("mx_skip", "retry", 0, {}, 2, 2, "SUCCESS"),
    "retry-countdown-0-wait": ("mx_wait", "retry", 0, {}, 2, 2, "SUCCESS"),
    "retry-while-held-skip": ("mx_skip", "retry_held", 1.0, {}, 2, 2, "SUCCESS"),
    "retry-while-held-wait": ("mx_wait", "retry_held", 1.0, {}, 2, 2, "SUCCESS"),
    "autoretry-for": ("mx_auto", "fail_once", 0, {}, 2, 2, "SUCCESS"),
    "max-retries-exceeded": ("mx_skip", "retry_forever", 0, {}, 2, 2, "FAILURE"),
    "reject-no-requeue": ("mx_skip", "reject", 0, {}, 1, 1, None),
    "ignore": ("mx_wait", "ignore", 0, {}, 1, 1, None),
    "soft-time-limit": ("mx_skip", "sleep", 5, {"soft_time_limit": 0.5}, 1, 1, "FAILURE"),
    "hard-time-limit": ("mx_wait", "sleep", 5, {"time_limit": 1}, 1, 0, "FAILURE"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_outcome_frees_both_keys(
    case: str,
    key: str,
    store: redis.Redis,
    observer: Observer,
    pair: list[WorkerProcess],
    pool: str,
) -> None:
    from tests.apps import exclusive

    task_name, mode, arg, options, n_starts, n_runs, state = CASES[case]
    if "soft_time_limit" in options and pool in NO_SOFT_LIMIT:
        state = "SUCCESS"
    if "time_limit" in options and pool in NO_HARD_LIMIT:
        state, n_runs = "SUCCESS", 1
    task = getattr(exclusive, task_name)
    keys = Keys(store, task, key)

    result = task.apply_async((key, mode, arg), **options)
    assert keys.unique_holder() in (result.id, None)  # claimed at publish (or done already)

    try:
        wait_until(lambda: len(starts(observer, key)) >= n_starts, 20, f"{n_starts} starts")
        wait_until(lambda: len(finished(observer, key)) >= n_runs, 20, f"{n_runs} runs")
    except AssertionError as exc:
        # What the workers said of it: a failure on a loaded machine names its cause.
        said = [
            f"{w.hostname}: {line}"
            for w in pair
            for line in w.log_text().splitlines()
            if result.id in line
        ]
        raise AssertionError(f"{exc}; the workers' lines of {result.id}: {said}") from exc
    if state is not None:
        result.get(timeout=20, propagate=False)
        assert result.state == state, result.result
    keys.assert_settle_free()

    runs = starts(observer, key)
    assert len(runs) == n_starts
    assert {s["task_id"] for s in runs} == {result.id}
    assert [s["fence"] for s in runs] == sorted({s["fence"] for s in runs})  # increasing
    assert_no_overlap(finished(observer, key))
    assert_fences_increase(finished(observer, key))
    if mode == "retry_held":  # the retry met its own first run's lease: it waited
        assert any(f"[{result.id}] held for" in w.log_text() for w in pair)


def test_failure_states_name_their_cause(store: redis.Redis, observer: Observer, pool: str) -> None:
    from celery.exceptions import MaxRetriesExceededError, SoftTimeLimitExceeded

    from tests.apps.exclusive import mx_skip, mx_wait

    key = f"causes-{uuid.uuid4().hex[:8]}"
    retried = mx_skip.apply_async((f"{key}-1", "retry_forever"))
    soft = mx_skip.apply_async((f"{key}-2", "sleep", 5), soft_time_limit=0.5)
    hard = mx_wait.apply_async((f"{key}-3", "sleep", 5), time_limit=1)
    with pytest.raises(MaxRetriesExceededError):
        retried.get(timeout=20)
    if pool in NO_SOFT_LIMIT:
        assert soft.get(timeout=20) == "sleep"
    else:
        with pytest.raises(SoftTimeLimitExceeded):
            soft.get(timeout=20)
    if pool in NO_HARD_LIMIT:
        assert hard.get(timeout=20) == "sleep"
    else:
        with pytest.raises(Exception, match=r"TimeLimitExceeded|Time limit"):
            hard.get(timeout=20)


def test_a_pending_retry_keeps_the_unique_key_but_not_the_lease(
    key: str, store: redis.Redis, observer: Observer
) -> None:
    from tests.apps.exclusive import mx_wait

    keys = Keys(store, mx_wait, key)
    result = mx_wait.apply_async((key, "retry", 4))
    wait_until(lambda: len(finished(observer, key)) == 1, 20, "first attempt ran")
    # Between the attempts: no run holds the lease, the publish claim stays with the id.
    wait_until(lambda: not keys.owners(), 2, "lease released at the retry")
    assert keys.unique_holder() == result.id
    assert mx_wait.delay(key).id == result.id  # still deduplicated
    assert len(finished(observer, key)) == 1, "checked during the countdown"

    assert result.get(timeout=20) == "retry"
    keys.assert_settle_free()
    assert len(finished(observer, key)) == 2


def test_revoked_before_its_eta(key: str, store: redis.Redis, observer: Observer) -> None:
    from tests.apps.exclusive import mx_skip

    keys = Keys(store, mx_skip, key)
    result = mx_skip.apply_async((key,), countdown=1.5)
    result.revoke()
    wait_until(lambda: result.state == "REVOKED", 20, "revoked")
    keys.assert_settle_free()
    time.sleep(1.0)  # past its eta (1.5 s): a revoked run that still ran would start now
    assert starts(observer, key) == []


def test_revoked_while_held_behind_its_key(
    key: str, store: redis.Redis, observer: Observer, pair: list[WorkerProcess]
) -> None:
    """Held in the consumer (wait), revoked there: it never runs; both keys end free."""
    from tests.apps.exclusive import mx_wait

    holder = mx_wait.apply_async((key, "sleep", 2.0), {"n": 0})
    wait_until(lambda: starts(observer, key), 20, "holder started")
    waiter = mx_wait.apply_async((key,), {"n": 1})
    waiter_keys = Keys(store, mx_wait, key, n=1)
    assert waiter_keys.unique_holder() == waiter.id
    wait_until(lambda: any(f"[{waiter.id}] held" in w.log_text() for w in pair), 10, "waiter held")
    waiter.revoke()

    assert holder.get(timeout=20) == "sleep"
    wait_until(lambda: waiter.state == "REVOKED", 20, "waiter revoked")
    waiter_keys.assert_settle_free()
    Keys(store, mx_wait, key, n=0).assert_settle_free()
    time.sleep(0.5)  # the revoked waiter, had it been admitted, would start now
    assert [s["task_id"] for s in starts(observer, key)] == [holder.id]


def test_revoked_with_terminate(
    key: str, store: redis.Redis, observer: Observer, pair: list[WorkerProcess], pool: str
) -> None:
    from tests.apps.exclusive import mx_wait

    if pool in NO_HARD_LIMIT:
        pytest.skip(
            f"the {pool} pool cannot stop a run: a revoke(terminate=True) keeps the key "
            "until the body returns (tests/pools/test_refused.py)"
        )

    keys = Keys(store, mx_wait, key)
    result = mx_wait.apply_async((key, "sleep", 30))
    wait_until(lambda: starts(observer, key), 20, "started")
    assert keys.owners()
    result.revoke(terminate=True)
    wait_until(lambda: result.state == "REVOKED", 20, "revoked")
    keys.assert_settle_free()
    assert all(worker.is_running for worker in pair)
    # The key is usable again at once.
    assert mx_wait.apply_async((key,), {"n": 1}).get(timeout=20) == "ok"


def test_expired_while_held_behind_its_key(
    key: str, store: redis.Redis, observer: Observer
) -> None:
    from tests.apps.exclusive import mx_wait

    holder = mx_wait.apply_async((key, "sleep", 2.0), {"n": 0})
    wait_until(lambda: starts(observer, key), 20, "holder started")
    expires = datetime.now(timezone.utc) + timedelta(seconds=1)
    waiter = mx_wait.apply_async((key,), {"n": 1}, expires=expires)
    waiter_keys = Keys(store, mx_wait, key, n=1)
    assert waiter_keys.unique_holder() == waiter.id
    # The claim lasts no longer than the call (a datetime expires, as seconds would).
    assert 0 < store.pttl(waiter_keys.unique) <= 1_000

    assert holder.get(timeout=20) == "sleep"
    wait_until(lambda: waiter.state == "REVOKED", 20, "waiter expired")
    waiter_keys.assert_settle_free()
    assert [s["task_id"] for s in starts(observer, key)] == [holder.id]


def test_expired_before_delivery(key: str, store: redis.Redis, observer: Observer) -> None:
    from tests.apps.exclusive import mx_skip

    keys = Keys(store, mx_skip, key)
    expires = datetime.now(timezone.utc) - timedelta(seconds=1)
    result = mx_skip.apply_async((key,), expires=expires)
    wait_until(lambda: result.state == "REVOKED", 20, "expired")
    keys.assert_settle_free()
    assert starts(observer, key) == []


def test_a_retry_while_its_first_run_still_holds_the_key_waits_even_with_skip(
    key: str, store: redis.Redis, observer: Observer, pair: list[WorkerProcess]
) -> None:
    """The retry message is published while the lease is still held by the same task id;
    with skip it must not be skipped (that would lose the task), it waits and runs."""
    from tests.apps.exclusive import mx_skip

    results = [mx_skip.apply_async((key, "retry", 0), {"n": n}) for n in range(3)]
    # The three share the exclusive key: some are skipped, the rest retry and finish.
    states = set()
    for result in results:
        result.get(timeout=20, propagate=False)
        states.add(result.state)
    assert states <= {"SUCCESS", "FAILURE"}
    done = [r for r in results if r.state == "SUCCESS"]
    assert done, "at least the first one ran"
    for result in done:
        assert [s["task_id"] for s in starts(observer, key)].count(result.id) == 2
    for n in range(3):
        Keys(store, mx_skip, key, n=n).assert_settle_free()
    assert_no_overlap(finished(observer, key))
