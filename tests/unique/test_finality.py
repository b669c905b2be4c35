"""Finality is read from what Celery did with the message, not guessed (issue 11, 5 and 4).

Whether a delivery is over for good (free the unique key, write the done marker) or
comes back (keep them) is what Celery decided: acked, rejected with requeue, retried.
Each test here ends a task in a way where the exception alone says otherwise; the
observer (outside the library) and the result backend say what really happened.

Item 4 is the other half of "a unique key is held while its task is queued or
running": a message's ``expires`` bounds how long it may wait in the queue, not how
long its run is protected.
"""

from __future__ import annotations

import itertools
import re
import time
from collections.abc import Iterator

import pytest
import redis

from tests.support.observer import Observer
from tests.support.waiting import wait_until
from tests.support.workers import Workers

APP = "tests.apps.finality"


@pytest.fixture
def store(store_url: str) -> Iterator[redis.Redis]:
    with redis.Redis.from_url(store_url, decode_responses=True) as client:
        yield client


def test_retries_used_up_after_lost_workers_free_the_unique_key(
    workers: Workers, observer: Observer, store: redis.Redis
) -> None:
    """5a: ``retry_on_worker_lost`` with ``max_retries=1``; the pool child dies on every
    run. Celery retries once under the same id, then fails the task for good: the
    unique key is free, and a new publish of it is queued and runs."""
    from tests.apps.finality import lost_every_run, unique_key

    workers.start(APP, concurrency=1)
    first = lost_every_run.delay("5a")
    key = unique_key(lost_every_run, "5a")
    assert store.get(key) == first.id

    starts = observer.starts_of("5a", n=2, timeout=30)
    assert {s["task_id"] for s in starts} == {first.id}  # the retry kept the id
    wait_until(lambda: first.state == "FAILURE", 30, "Celery to fail the task for good")
    wait_until(lambda: store.get(key) is None, 10, "the unique key of a dead task freed")

    second = lost_every_run.delay("5a", die=False)
    assert second.id != first.id, "deduplicated against a task that failed for good"
    assert second.get(timeout=30) == "ran"
    assert len(observer.starts_of("5a", n=3)) == 3


def test_a_task_that_exits_under_reject_on_worker_lost_runs_again(
    workers: Workers, observer: Observer, store: redis.Redis
) -> None:
    """5b: ``acks_late`` + ``reject_on_worker_lost`` + redelivery guard; the task calls
    ``sys.exit()`` on its first delivery. Celery requeues the message: the copy is not a
    "finished" id, it runs, and the task succeeds."""
    from tests.apps.finality import exited_mark, exits_once

    worker = workers.start(APP, concurrency=1)
    result = exits_once.delay("5b")

    assert result.get(timeout=30) == "ran"
    assert observer._redis.exists(exited_mark(result.id))  # the first delivery exited
    assert [r.task_id for r in observer.runs_of("5b")] == [result.id]  # the copy ran
    assert len(observer.started()) == 1
    assert "already finished" not in worker.log_text()
    # The copy's run was the final one: its message (the id's one publish) is marked
    # done (once the worker's main process handled the result the child stored).
    done = f"baton:{{{exits_once.name}}}:done:{result.id}"
    wait_until(lambda: store.exists(done), 10, "the message marked done")
    (stamp,) = store.zrange(done, 0, -1)
    assert re.fullmatch(r"[0-9a-f]+\.[0-9a-f]{12}", stamp), stamp  # the publish stamp


def test_a_worker_lost_after_success_was_stored_frees_the_unique_key(
    workers: Workers, observer: Observer, store: redis.Redis
) -> None:
    """5c: the pool child dies after the result backend stored SUCCESS (in a
    ``task_postrun`` handler). Celery keeps the SUCCESS and acks the message: the run is
    over, so the unique key is free."""
    from tests.apps.finality import dies_after_success, unique_key

    worker = workers.start(APP, concurrency=1)
    first = dies_after_success.delay("5c")
    key = unique_key(dies_after_success, "5c")
    assert first.get(timeout=30) == "ran"

    lost = rf"dies_after_success\[{first.id}\] succeeded before the worker was lost"
    wait_until(lambda: re.search(lost, worker.log_text()), 30, "Celery to see the lost child")
    wait_until(lambda: store.get(key) is None, 10, "the unique key of a finished task freed")
    second = dies_after_success.delay("5c")
    assert second.id != first.id, "deduplicated against a task that succeeded"
    assert second.get(timeout=30) == "ran"


@pytest.mark.parametrize("task_name", ["uq_long", "uq_long_gated"])
def test_unique_with_expires_holds_while_the_task_runs(
    workers: Workers, observer: Observer, store: redis.Redis, task_name: str
) -> None:
    """4: ``expires=2`` on a 6 s run. The claim's ttl is cut to 2 s at publish (a message
    that expires unqueued frees its key), but once the task started its key is held
    until it finishes: a publish at 3 s is deduplicated, and the key is free after."""
    from tests.apps import finality

    task = getattr(finality, task_name)
    workers.start(APP, concurrency=2)
    published = time.monotonic()
    first = task.apply_async(("k4", 6.0), expires=2)
    observer.starts_of("k4", timeout=2)  # (it must start before it expires)
    time.sleep(max(0.0, published + 3.0 - time.monotonic()))

    again = task.apply_async(("k4", 6.0), expires=2)
    assert again.id == first.id, "queued beside a unique task that is still running"
    assert first.get(timeout=30) == first.id
    wait_until(lambda: store.get(finality.unique_key(task, "k4", 6.0)) is None, 10, "key freed")
    time.sleep(1.0)  # a second run, if one were queued, would start now
    assert [s["task_id"] for s in observer.started()] == [first.id]
    assert observer.max_running("k4") == 1


@pytest.mark.parametrize("expires", [None, 3.0], ids=["plain", "expires"])
def test_a_killed_workers_unique_run_keeps_its_key_until_the_broker_gives_it_back(
    workers: Workers, observer: Observer, store: redis.Redis, expires: float | None
) -> None:
    """A unique ``acks_late`` task whose worker is SIGKILLed mid-run: its message is the
    broker's again (redelivered after ``visibility_timeout``), so a publish meanwhile is
    deduplicated into it, and that id must then run or end for good. Without ``expires``
    the redelivered copy runs (the id returned to the duplicate is the work done). With
    ``expires`` the copy comes back expired: Celery discards it (REVOKED) and the key is
    freed at once, so the next publish is queued and runs (nothing waits for
    ``unique_ttl``)."""
    from tests.apps.finality import unique_key, uq_late

    env = {"FINALITY_VISIBILITY": "4"}
    first_worker = workers.start(APP, concurrency=1, env=env)
    options = {"expires": expires} if expires else {}
    first = uq_late.apply_async(("kw", 3.0), **options)
    key = unique_key(uq_late, "kw", 3.0)
    observer.starts_of("kw", timeout=10)
    first_worker.kill()
    # Published before the next worker starts: no worker can give the message back (and,
    # with expires, discard it) meanwhile, however long a start takes on a loaded machine.
    again = uq_late.apply_async(("kw", 3.0), **options)
    assert again.id == first.id, "queued beside a run whose message the broker still owns"
    workers.start(APP, concurrency=1, env=env)
    if expires is None:
        assert first.get(timeout=30) == first.id  # the redelivered copy ran
        assert [s["task_id"] for s in observer.started()] == [first.id, first.id]
    else:
        wait_until(lambda: first.state == "REVOKED", 30, "the expired copy to be discarded")
        assert len(observer.started()) == 1  # the copy did not run
    wait_until(lambda: store.get(key) is None, 10, "the key freed when the id ended")
    after = uq_late.apply_async(("kw", 3.0), **options)
    assert after.id != first.id, "deduplicated into a task that ended"
    assert after.get(timeout=30) == after.id
    # (max_running counts the killed run as running forever: compare finished runs)
    finished = sorted(observer.runs_of("kw"), key=lambda r: r.start)
    assert all(a.end <= b.start for a, b in itertools.pairwise(finished)), finished


def test_an_expiring_unique_run_lost_with_its_worker_frees_its_key_within_lease_ttl(
    workers: Workers, observer: Observer, store: redis.Redis
) -> None:
    """The soak's finding: a unique ``acks_late`` run with ``expires=3`` whose worker is
    SIGKILLed. The broker gives its message back only after ``visibility_timeout``
    (10 s), past its expiry: Celery will discard that copy, so the id will never run.
    A publish at 5 s (past the message's expiry and past ``lease_ttl``, 2 s, after the
    kill) must be queued and run, not deduplicated into a task that ends REVOKED; and
    the copy, discarded, must not run beside it."""
    from tests.apps.finality import uq_late_short

    env = {"FINALITY_VISIBILITY": "10"}
    first_worker = workers.start(APP, concurrency=1, env=env)
    published = time.monotonic()
    first = uq_late_short.apply_async(("kl", 20.0), expires=3)
    observer.starts_of("kl", timeout=3)
    first_worker.kill()
    workers.start(APP, concurrency=1, env=env)
    time.sleep(max(0.0, published + 5.0 - time.monotonic()))

    again = uq_late_short.apply_async(("kl", 1.0), expires=3)
    assert again.id != first.id, "deduplicated into a task whose message will be discarded"
    assert again.get(timeout=30) == again.id
    wait_until(lambda: first.state == "REVOKED", 30, "the expired copy to be discarded")
    assert [s["task_id"] for s in observer.started()] == [first.id, again.id]
