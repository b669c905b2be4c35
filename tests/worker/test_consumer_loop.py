"""The consumer's event loop while the store hangs (issue 11, items 7 and 8).

* Item 7: no store call may block the consumer's loop. Revoked unique tasks free their
  unique keys and guarded tasks give back leases; with the store SIGSTOPped those calls
  cannot be answered, and if one of them waits on the loop, every plain task on that
  worker waits too. Measured from outside: the start delay of plain tasks published
  while the store is paused (observer's clock against the publish time).
* Item 8: a gate call whose reply is lost (the channel broke while the store held it)
  may still be executed by the store when it resumes; whatever it granted to an owner
  that is not running must be given back, or the key stays taken for ``lease_ttl``.
"""

from __future__ import annotations

import statistics
import time

import pytest

from tests.support.observer import Observer
from tests.support.servers import StoreServer
from tests.support.waiting import broadcast, wait_until
from tests.support.workers import Workers

APP = "tests.apps.loop"


@pytest.mark.timeout(120)  # ~15-30 s here; 60 s is the default
def test_plain_tasks_keep_flowing_while_the_store_hangs(
    workers: Workers, observer: Observer, store_server: StoreServer
) -> None:
    from tests.apps import loop

    worker = workers.start(APP, concurrency=2)
    loop.exclusive_skip.delay("warm")
    observer.runs_of("warm", 1)  # the worker's store channel is connected

    # Unique claims need the store: publish before pausing, to a queue nobody consumes
    # yet, and revoke them all. When the worker receives them, each revoked message
    # frees its unique key: a store call on the consumer's loop.
    keys = [f"r{i}" for i in range(8)]
    ids = [loop.unique_later.delay(key).id for key in keys]
    replies = broadcast(loop.app, lambda: loop.app.control.revoke(ids, reply=True, timeout=10))
    assert len(replies) == 1, replies

    sent: dict[str, float] = {}
    store_server.pause()
    try:
        replies = broadcast(
            loop.app,
            lambda: loop.app.control.add_consumer(
                "later", destination=[worker.hostname], reply=True, timeout=10
            ),
        )
        assert len(replies) == 1, replies
        for _ in range(10):
            sent[loop.plain.delay().id] = time.time()
            time.sleep(0.3)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if len([s for s in observer.started() if s["key"] == "plain"]) >= len(sent):
                break
            time.sleep(0.1)
        started = {s["task_id"]: s["start"] / 1e6 for s in observer.started()}
        waited_until = time.time()
    finally:
        store_server.resume()

    delays = [started.get(task_id, waited_until) - at for task_id, at in sent.items()]
    median = statistics.median(delays)
    assert median < 1.0, (
        f"plain tasks waited {median:.2f} s (median) while the store hung: "
        f"{sorted(round(d, 2) for d in delays)}"
    )
    assert worker.is_running

    # Once the store is back, the revoked tasks' unique keys are freed (in the
    # background), and none of them ran.
    with store_server.client() as store:
        unique = [
            loop.baton.policy_for(loop.unique_later).unique_key(loop.baton.names, (key,), {})
            for key in keys
        ]
        wait_until(lambda: store.exists(*unique) == 0, 20, "revoked tasks' unique keys are freed")
    assert not [s for s in observer.started() if s["key"].startswith("unique:")]


def test_a_lost_gate_reply_does_not_keep_the_key(
    workers: Workers, observer: Observer, store_server: StoreServer
) -> None:
    """The store hangs while a gate call is in flight: the channel gives up after
    ``baton_socket_timeout`` and (``baton_on_store_error="run"``) the task runs
    unguarded. When the store resumes it executes the buffered call and grants the
    lease to that delivery's owner, who will never release it. The next run of the key
    must not be skipped for ``lease_ttl`` (30 s) because of it."""
    from tests.apps import loop

    worker = workers.start(APP, concurrency=2, env={"BATON_TEST_ON_STORE_ERROR": "run"})
    loop.exclusive_skip.delay("warm")
    observer.runs_of("warm", 1)

    store_server.pause()
    try:
        loop.exclusive_skip.delay("lost")
        observer.starts_of("lost", 1, timeout=20)  # given up on the store: ran unguarded
    finally:
        store_server.resume()
    observer.runs_of("lost", 1)
    assert "UNGUARDED" in worker.log_text()
    time.sleep(1.0)  # the store has executed what it buffered

    loop.exclusive_skip.delay("lost")
    observer.runs_of("lost", 2, timeout=10)
    assert worker.is_running


@pytest.mark.timeout(120)  # ~15-30 s here; 60 s is the default
def test_a_lost_gate_reply_of_a_request_revoked_while_held_does_not_keep_the_key(
    workers: Workers, observer: Observer, store_server: StoreServer
) -> None:
    """The same with ``baton_on_store_error="hold"``: the request whose gate reply was
    lost is held, then revoked; it never runs, and nothing it may have been granted by
    the buffered call outlives it."""
    from tests.apps import loop

    worker = workers.start(APP, concurrency=2)
    loop.exclusive_skip.delay("warm")
    observer.runs_of("warm", 1)

    store_server.pause()
    try:
        held = loop.exclusive_skip.delay("revoked")
        wait_until(lambda: f"[{held.id}], retry in" in worker.log_text(), 20, "the request is held")
        replies = broadcast(
            loop.app, lambda: loop.app.control.revoke(held.id, reply=True, timeout=10)
        )
        assert len(replies) == 1, replies
    finally:
        store_server.resume()
    time.sleep(1.0)  # the store has executed what it buffered

    loop.exclusive_skip.delay("revoked")
    runs = observer.runs_of("revoked", 1, timeout=15)
    assert [r.task_id for r in runs] != [held.id]
    assert worker.is_running
