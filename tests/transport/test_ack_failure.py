"""A broker ack that fails does not end a delivery (issue 11: finality read from Celery).

When the broker does not answer an ack, kombu logs "Couldn't ack" and goes on, and
Celery's ``Request.acknowledge()`` still marks the request acknowledged; the message
stays unacked on the broker and comes back (Redis: after ``visibility_timeout``). The
unique key must then stay with the task id whose copy will run again: a publish of the
key meanwhile is deduplicated against it, and the copy frees the key when it ends.

When the ack only timed out, the broker may have executed it after all: a redis-server
that was SIGSTOPped reads the timed-out command when it goes on. Then no copy comes,
and the key must be free as soon as the broker tells so, not held for the copy that
never comes (the 20-minute soak of seed 1105: a key held 26 s after the broker answered,
7 publishes deduplicated into a task that had ended).

The broker here is the test's own redis-server, paused while a run returns.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis

from tests.support.celery_processes import WorkerProcess
from tests.support.observer import Observer
from tests.support.servers import StoreServer
from tests.support.waiting import wait_until
from tests.support.workers import Workers

APP = "tests.apps.ackfail"
KEPT_TTL_MS = 60_000  # the claim's ttl while its copy comes back: a few visibility_timeouts


@pytest.fixture
def store(store_url: str) -> Iterator[redis.Redis]:
    with redis.Redis.from_url(store_url, decode_responses=True) as client:
        yield client


def _pause_broker_until_the_ack_failed(
    broker: StoreServer, observer: Observer, worker: WorkerProcess, task_id: str
) -> None:
    """Pause the broker's writes (``CLIENT PAUSE WRITE``) as the run returns; unpause
    once Celery gave up the ack (kombu's client tries it several times, with back-off,
    before "Couldn't ack"). Each try times out and closes its connection; the server
    drops a paused command whose client is gone: the ack never happened.

    (SIGSTOP, by contrast, keeps the server from seeing the close: the timed-out ack is
    often executed when it goes on, and the message does not come back. A broker that
    crashes makes Celery's consumer restore the message on its own reconnect.)"""
    from tests.apps.ackfail import stop_mark

    wait_until(lambda: observer._redis.exists(stop_mark(task_id)), 20, "the run to ask")
    with broker.client() as admin:
        admin.execute_command("CLIENT", "PAUSE", 60_000, "WRITE")
        try:
            wait_until(lambda: "Couldn't ack" in worker.log_text(), 30, "the ack to fail")
        finally:
            admin.execute_command("CLIENT", "UNPAUSE")


def test_a_run_whose_ack_failed_keeps_its_unique_key(
    workers: Workers,
    observer: Observer,
    store: redis.Redis,
    broker_server: StoreServer,
) -> None:
    """The first run's ack fails: its message comes back. A publish of the same key
    meanwhile returns the first task's id (queues nothing); the key is free once the
    copy ended (it runs again)."""
    from tests.apps import ackfail

    task = ackfail.uq_ack
    worker = workers.start(APP, concurrency=2)
    first = task.delay("ka")
    key = ackfail.unique_key(task, "ka")
    _pause_broker_until_the_ack_failed(broker_server, observer, worker, first.id)

    # The run's end reached the store: its claim kept for the copy (a ttl shorter than
    # the unique_ttl it had while it ran).
    wait_until(lambda: 0 < store.pttl(key) <= KEPT_TTL_MS, 10, "the run's end handled")
    assert store.get(key) == first.id, "the claim of a run whose ack failed was freed"
    again = task.delay("ka")
    assert again.id == first.id, "queued beside a task whose message comes back"

    runs = observer.runs_of("ka", n=2, timeout=30)
    assert [r.task_id for r in runs] == [first.id, first.id]
    # Freed by the copy's end, not by the kept claim's ttl (over 20 s: it covers the
    # broker's visibility_timeout twice).
    wait_until(lambda: store.get(key) is None, 3, "the copy to free the key")
    time.sleep(1.0)  # a second publish, had one been queued, would have run by now
    assert {s["task_id"] for s in observer.started()} == {first.id}
    assert len(observer.started()) == 2

    third = task.delay("ka")
    assert third.id != first.id, "the key stayed claimed after the copy ended"
    wait_until(lambda: len(observer.runs_of("ka", n=1)) == 3, 30, "run")


def test_a_run_whose_timed_out_ack_the_broker_executed_frees_its_unique_key(
    workers: Workers,
    observer: Observer,
    store: redis.Redis,
    broker_server: StoreServer,
) -> None:
    """The run stops the broker (SIGSTOP) as it returns: the ack is written to it, times
    out ("Couldn't ack"), and the worker keeps the claim for a copy. The broker, resumed,
    runs the ack it had read: nothing comes back, and the key is free within seconds
    (not after the redelivery window, 21 s here); the next publish is queued and runs."""
    from tests.apps import ackfail

    task = ackfail.uq_stops_broker
    observer._redis.set(ackfail.broker_pid_mark(), str(broker_server.pid))
    worker = workers.start(APP, concurrency=2)
    first = task.delay("kb")
    key = ackfail.unique_key(task, "kb")
    try:
        wait_until(lambda: "Couldn't ack" in worker.log_text(), 40, "the ack to fail")
    finally:
        broker_server.resume()
    with broker_server.client() as broker:
        # The scenario: the timed-out ack ran when the broker went on (checked before the
        # visibility_timeout of 10 s could restore the message).
        broker.ping()
        assert broker.hlen("unacked") == 0, "the ack did not run late: not this scenario"
        assert broker.llen("celery") == 0, "the message came back: not this scenario"
    # The key is None before the worker kept it for the copy too (the run's end freed
    # it): a CI run read that gap as the end of the story, and its publish met the kept
    # claim. So the worker's conclusion first, then the key; the keep and the free go
    # out on one channel, the free after the keep, so a key still free a second after
    # it was seen free (both landed) stays free.
    wait_until(
        lambda: f"the broker ran the ack of {first.id} after all" in worker.log_text(),
        8,
        "the worker to find that the broker ran the ack",
    )
    for _ in range(2):
        wait_until(
            lambda: store.get(key) is None,
            8,
            "the key freed once the broker showed the ack landed",
        )
        time.sleep(1.0)
    second = task.delay("kb")
    assert second.id != first.id, "deduplicated into a run that ended and was acked"
    runs = observer.runs_of("kb", n=2, timeout=30)
    assert [r.task_id for r in runs] == [first.id, second.id]
    time.sleep(1.0)  # the first task's copy, were it run again, would start now
    assert len(observer.started()) == 2, "the first task ran again"


def test_under_the_guard_a_run_whose_ack_failed_frees_its_unique_key(
    workers: Workers,
    observer: Observer,
    store: redis.Redis,
    broker_server: StoreServer,
) -> None:
    """Under the redelivery guard the copy of a run that ended will not run (its pool
    process recorded the end: worker/pool/run_end.py), so the key is free at the run's end,
    whatever became of the ack: a publish meanwhile is queued and runs, and the copy is
    acked without a run."""
    from tests.apps import ackfail

    task = ackfail.uq_ack_guarded
    worker = workers.start(APP, concurrency=2)
    first = task.delay("ka")
    key = ackfail.unique_key(task, "ka")
    _pause_broker_until_the_ack_failed(broker_server, observer, worker, first.id)

    assert store.get(key) is None, "the key of a run that ended is still claimed"
    again = task.delay("ka")
    assert again.id != first.id, "deduplicated into a run that ended"
    wait_until(lambda: f"{first.id}] skipped" in worker.log_text(), 30, "the copy skipped")
    observer.runs_of("ka", n=2, timeout=30)
    time.sleep(1.0)  # the skipped copy, were it run after all, would start now
    assert sorted(s["task_id"] for s in observer.started()) == sorted([first.id, again.id])
