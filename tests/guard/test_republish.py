"""The redelivery guard refuses a redelivered copy, not a new publish of a task id (issue 25).

Celery sends a task id again on purpose in ordinary code: ``Task.replace()`` (the
replacement takes the replaced task's id; for a chain, its last task does), a frozen
chord or signature applied twice, one frozen errback linked in two canvases, and
``apply_async(task_id=...)``. Each is a new message and must run under the guard; a
copy of a message that ran (tests/guard/test_redelivery.py) still must not.

The store is not declared new (``forget``): the first lease waits out the store's grace,
which each test absorbs with one warm-up task before it measures anything.
"""

from __future__ import annotations

import re

import pytest

from tests.support.celery_processes import WorkerProcess
from tests.support.observer import Observer
from tests.support.servers import StoreServer
from tests.support.waiting import wait_until
from tests.support.workers import Workers

APP = "tests.apps.republish"
GRACE = 60  # seconds for the warm-up: the store's grace (one lease_ttl, 30 s) and more
TIMEOUT = 20  # seconds for a result once past the grace


@pytest.fixture
def store(store_server: StoreServer, store_url: str) -> str:
    """The store, emptied without the known-new mark (as a first deployment finds it)."""
    store_server.forget()
    return store_url


def _worker(workers: Workers, *, acks_late: bool = False) -> WorkerProcess:
    from tests.apps import republish

    env = {"REPUBLISH_ACKS_LATE": "1" if acks_late else "0"}
    worker = workers.start(APP, env=env, concurrency=2)
    # Past the store's grace before anything is measured (tests the worker runs too).
    assert republish.add.delay(1, 1, "warm-up").get(timeout=GRACE) == 2
    return worker


def _runs(observer: Observer, key: str) -> int:
    return sum(1 for s in observer.started() if s["key"] == key)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("acks_late", [False, True], ids=["acks-early", "acks-late"])
def test_a_task_that_replaces_itself_completes(
    workers: Workers, observer: Observer, store: str, acks_late: bool
) -> None:
    """``self.replace(self.si(n - 1))`` three times: each replacement carries the same task
    id, and each must run; ``.get()`` on the first id returns the last run's value."""
    from tests.apps import republish

    _worker(workers, acks_late=acks_late)
    result = republish.countdown.delay(3, "countdown")
    assert result.get(timeout=TIMEOUT) == 3  # the replacement depth of the last run
    assert _runs(observer, "countdown") == 4


@pytest.mark.timeout(180)
def test_a_chain_ending_in_a_replacing_task_completes(
    workers: Workers, observer: Observer, store: str
) -> None:
    """A chain whose last task replaces itself (twice), and a task that replaces itself
    with a chain ending in itself (the chain's last task takes its id)."""
    from celery import chain

    from tests.apps import republish

    _worker(workers)
    result = chain(republish.add.si(1, 2), republish.countdown.si(2, "last")).delay()
    assert result.get(timeout=TIMEOUT) == 2
    nested = republish.countdown_by_chain.delay(2, "by-chain")
    assert nested.get(timeout=TIMEOUT) == 2
    assert (_runs(observer, "last"), _runs(observer, "by-chain")) == (3, 3)


@pytest.mark.timeout(180)
def test_a_replacement_that_arrives_while_the_replaced_run_holds_its_lease_waits_and_runs(
    workers: Workers, observer: Observer, store: str
) -> None:
    """The replaced run lingers 2 s after sending its replacement: the replacement is
    held on the run lease of the task id (not run beside it, not skipped), then runs."""
    from tests.apps import republish

    worker = _worker(workers)
    result = republish.replaces_slowly.delay(1, "slow", 2.0)
    assert result.get(timeout=TIMEOUT) == 0
    assert len(observer.runs_of("slow", 2)) == 2
    assert observer.max_running("slow") == 1  # never beside the lingering run
    log = worker.log_text()
    assert re.search(rf"replaces_slowly\[{result.id}\] held for \S+:run:", log), log[-3000:]


@pytest.mark.timeout(180)
def test_a_frozen_chord_applied_twice_runs_twice(
    workers: Workers, observer: Observer, store: str
) -> None:
    """Applying a frozen chord again sends its header and body under the same ids: a new
    publish, so the body runs again."""
    from celery import chord

    from tests.apps import republish

    _worker(workers)
    frozen = chord(
        [republish.add.si(1, 1, "header"), republish.add.si(2, 2, "header")],
        republish.total.s("body"),
    )
    frozen.freeze()
    assert frozen.apply_async().get(timeout=TIMEOUT) == 6
    # Celery (5.7) finishes a chord in the pool process after sending its body: it
    # clears the chord's state and marks the group done. Applied again before that,
    # the second run meets the first's state and Celery itself may not send the body
    # again (seen on a loaded machine): wait for Celery's own end of the first run.
    backend = republish.app.backend
    group_id = frozen.tasks.options["task_id"]  # the header group's id
    if hasattr(backend, "get_key_for_group"):
        done_key = backend.get_key_for_group(group_id, ".c")
        wait_until(
            lambda: backend.client.get(done_key) in (None, b"done"), TIMEOUT, "the chord's end"
        )
    frozen.apply_async()
    observer.starts_of("body", 2, timeout=TIMEOUT)
    assert (_runs(observer, "header"), _runs(observer, "body")) == (4, 2)


@pytest.mark.timeout(180)
def test_one_frozen_errback_in_two_canvases_runs_for_each(
    workers: Workers, observer: Observer, store: str
) -> None:
    """One frozen errback linked to two failing tasks: it is sent twice under one id,
    and runs for each failure."""
    from tests.apps import republish

    _worker(workers)
    errback = republish.on_error.s("errback")
    errback.freeze()
    first = republish.fails.si("fails").on_error(errback).delay()
    with pytest.raises(ValueError):
        first.get(timeout=TIMEOUT)
    observer.starts_of("errback", 1, timeout=TIMEOUT)
    second = republish.fails.si("fails").on_error(errback).delay()
    with pytest.raises(ValueError):
        second.get(timeout=TIMEOUT)
    observer.starts_of("errback", 2, timeout=TIMEOUT)
    assert _runs(observer, "fails") == 2


@pytest.mark.timeout(180)
def test_apply_async_with_a_finished_task_id_runs_again(
    workers: Workers, observer: Observer, store: str
) -> None:
    """``apply_async(task_id=X)`` after X finished is a new publish: it runs."""
    from tests.apps import republish

    _worker(workers)
    first = republish.add.delay(2, 3, "again")
    assert first.get(timeout=TIMEOUT) == 5
    second = republish.add.apply_async((4, 5, "again"), task_id=first.id)
    assert second.id == first.id
    # (Its result is not stored: Celery never overwrites a task id's SUCCESS.)
    assert len(observer.runs_of("again", 2, timeout=TIMEOUT)) == 2
