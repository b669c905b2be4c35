"""kombu's records and acks sent without waiting (worker/transport/broker_writes.py),
judged where a user meets them: which task ran, and how often.

* The broker paused mid-drain (SIGSTOP, longer than its connection's ``socket_timeout``):
  writes in flight are given up. No task is lost; under the redelivery guard each runs
  once; without it, a task runs a second time only after an ack that was logged as
  failed ("Couldn't ack <its delivery tag>": the broker then delivers it again, as
  Celery's own failed acks do). A record given up whose ack went out on the next
  connection must not land after that ack (the message would come back after it ran).
* A warm shutdown mid-drain: every message the worker ran is gone from the broker,
  every other is back in its queue, none is both (the writes in flight were answered
  before kombu's channel closed and restored what it held), nothing is left unacked.

Pools with an event loop (prefork, threads, solo) send the writes so; gevent and
eventlet keep kombu's own (tests/transport/test_intake.py covers their intake).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import Counter

import pytest

from tests.support.observer import Observer
from tests.support.servers import StoreServer
from tests.support.waiting import wait_until
from tests.support.workers import Workers

APP = "tests.apps.broker_writes"
N = 80
PAUSE = 2.5  # seconds: over the broker connection's socket_timeout (1 s)
VISIBILITY = 10  # the app's visibility_timeout: an unacked message is back after it


def _tags_by_id(observer: Observer) -> dict[str, set[str]]:
    from tests.apps.broker_writes import TAGS

    tags: dict[str, set[str]] = {}
    for line in observer._redis.lrange(TAGS, 0, -1):
        task_id, _, tag = str(line).partition(" ")
        tags.setdefault(task_id, set()).add(tag)
    return tags


def _failed_acks(log: str) -> set[str]:
    """The delivery tags of every ack logged as failed (kombu's words or celery-baton's)."""
    return set(re.findall(r"Couldn't ack '?([0-9a-f-]{36})", log))


def _queued_ids(broker: StoreServer) -> list[str]:
    with broker.client() as client:
        return [
            json.loads(raw)["headers"]["id"]
            for key in client.keys("celery*")
            if client.type(key) == "list"
            for raw in client.lrange(key, 0, -1)
        ]


def _unacked(broker: StoreServer) -> int:
    with broker.client() as client:
        return int(client.hlen("unacked"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("pool", "task"),
    [
        ("prefork", "step"),
        ("prefork", "guarded_step"),
        ("threads", "guarded_step"),
        ("solo", "step"),
    ],
)
def test_a_drain_through_a_paused_broker_loses_nothing_and_runs_nothing_twice_unasked(
    pool: str, task: str, workers: Workers, observer: Observer, broker_server: StoreServer
) -> None:
    from tests.apps import broker_writes

    worker = workers.start(APP, pool=pool, concurrency=2)
    sent = [getattr(broker_writes, task).delay(i).id for i in range(N)]
    wait_until(lambda: len(observer.started()) >= 10, 30, "the drain to start")
    broker_server.pause()
    try:
        time.sleep(PAUSE)
    finally:
        broker_server.resume()
    resumed = time.monotonic()
    wait_until(
        lambda: {s["task_id"] for s in observer.started()} >= set(sent),
        60,
        "every task to run once the broker went on",
    )
    # A message whose ack did not land is delivered again after the visibility timeout:
    # judged once that has passed and the broker holds nothing more.
    time.sleep(max(0.0, resumed + VISIBILITY + 2 - time.monotonic()))
    wait_until(
        lambda: _unacked(broker_server) == 0 and not _queued_ids(broker_server),
        30,
        "every copy delivered again to have run",
    )
    runs = Counter(s["task_id"] for s in observer.started())
    twice = {task_id for task_id, n in runs.items() if n > 1}
    if task == "guarded_step":
        assert not twice, f"ran twice under the redelivery guard: {sorted(twice)}"
        return
    failed = _failed_acks(worker.log_text())
    tags = _tags_by_id(observer)
    assert all(tags.get(task_id, set()) - {""} for task_id in sent), "a run's tag unrecorded"
    unexplained = {task_id for task_id in twice if not tags.get(task_id, set()) & failed}
    assert not unexplained, (
        f"ran again though no ack of theirs failed: {sorted(unexplained)} "
        f"(failed acks: {sorted(failed)})"
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_a_warm_shutdown_mid_drain_leaves_each_message_run_or_queued_not_both(
    pool: str, workers: Workers, observer: Observer, broker_server: StoreServer
) -> None:
    from tests.apps import broker_writes

    worker = workers.start(APP, pool=pool, concurrency=2)
    sent = {broker_writes.step.delay(i).id for i in range(4 * N)}
    wait_until(lambda: len(observer.started()) >= N // 2, 30, "the drain to start")
    assert worker.stop(timeout=30) == 0
    ran = Counter(s["task_id"] for s in observer.started())
    queued = Counter(_queued_ids(broker_server))
    assert not [i for i, n in ran.items() if n > 1], "a task ran twice"
    assert not [i for i, n in queued.items() if n > 1], "a message was queued twice"
    assert set(ran) & set(queued) == set(), "ran, and back in its queue"
    assert set(ran) | set(queued) == sent, "lost: neither ran nor queued"
    assert _unacked(broker_server) == 0, "left unacked by a worker that is gone"


#: A Lua script that keeps the server busy (it answers no one) for ARGV[1] ms.
_SPIN = """
local t = redis.call('TIME')
local until_us = t[1] * 1000000 + t[2] + ARGV[1] * 1000
repeat t = redis.call('TIME') until t[1] * 1000000 + t[2] >= until_us
return 1
"""


@pytest.mark.timeout(120)
def test_acks_answered_while_long_bodies_ran_on_solos_loop_did_not_fail(
    workers: Workers, observer: Observer, broker_server: StoreServer
) -> None:
    """Solo runs each body on the worker's loop, which reads no reply of the broker
    while a body runs. A broker busy for moments (0.3 s in every 0.5 s here: a slow
    command, a fork for its snapshot) answers an ack just after the next body of 1.2 s
    started; the reply, there for a second, must not be given up for "no reply" (it
    was: "Couldn't ack" logged, and a record given up with it sent again after the
    ack, so that the broker delivered the message again a visibility timeout later and
    it ran twice). Nothing is paused: the broker connection's ``socket_timeout`` is 1 s."""
    from tests.apps import broker_writes

    worker = workers.start(APP, pool="solo")
    stop = threading.Event()

    def keep_the_broker_busy() -> None:
        with broker_server.client() as client:
            spin = client.register_script(_SPIN)
            while not stop.wait(0.2):
                spin(args=[300])

    busy = threading.Thread(target=keep_the_broker_busy, daemon=True)
    busy.start()
    try:
        sent = [broker_writes.long_step.delay(i, 1.2).id for i in range(6)]
        wait_until(lambda: {s["task_id"] for s in observer.started()} >= set(sent), 60, "every run")
    finally:
        stop.set()
        busy.join(timeout=10)
    time.sleep(VISIBILITY + 2)  # a message whose record outlived its ack comes back by now
    wait_until(lambda: _unacked(broker_server) == 0, 30, "nothing left unacked")
    runs = Counter(s["task_id"] for s in observer.started())
    assert not [task_id for task_id, n in runs.items() if n > 1], "a task ran twice"
    assert "Couldn't ack" not in worker.log_text()
