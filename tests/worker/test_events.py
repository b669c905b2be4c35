"""Task events for celery-baton's decisions, as a real event consumer sees them.

Issue 27 §2. A real worker (``-E``) and a real ``app.events.Receiver`` on the broker's
event exchange (tests/support/task_events.py): each decision kind arrives as a
``task-baton-*`` event of its task's uuid with its fields, and Celery's own
``events.state.State`` (what Flower and ``celery events`` use) files it under the task
with a state that says what happened. Without ``-E`` nothing is sent, until
``celery control enable_events``.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from typing import Any

import kombu
import pytest
from celery import Celery
from celery.events.state import State

from tests.support.servers import StoreServer
from tests.support.task_events import EventCapture
from tests.support.waiting import broadcast, wait_until
from tests.support.workers import Workers

APP = "tests.apps.events"


@pytest.fixture(autouse=True)
def known_new_store(store_server: StoreServer, store_url: str) -> None:
    """The store as a new deployment's: no grace before the first lease."""
    store_server.flushall()


def state_of(events: EventCapture, task_id: str) -> str:
    """The task's state as Flower and `celery events` would show it."""
    state = State()
    for event in list(events.events):
        state.event(dict(event))
    return str(state.tasks[task_id].state)


def test_held_and_admitted_name_what_the_task_waited_for(workers: Workers, broker_url: str) -> None:
    from tests.apps.events import fetch, wait_turn

    worker = workers.start(APP, concurrency=2, extra_args=["-E"])
    with EventCapture(broker_url) as events:
        # An exclusive key held by a run: the duplicate waits for it.
        first = wait_turn.delay("a", 1.5)
        events.wait_for("task-started", first.id, timeout=20)  # it holds the key
        second = wait_turn.delay("a", 0.0)
        held = events.wait_for("task-baton-held", second.id)
        assert held["reason"] == "exclusive"
        assert held["waiting_for"] == "exclusive key wait_turn(key='a')"
        assert held["key"] == "wait_turn(key='a')"
        assert held["hostname"] == worker.hostname
        assert state_of(events, second.id) == "BATON-HELD"
        admitted = events.wait_for("task-baton-admitted", second.id)
        assert admitted["reason"] == "exclusive"
        assert admitted["waiting_for"] == "exclusive key wait_turn(key='a')"
        assert 0.8 < admitted["waited"] < 5, admitted
        assert admitted["guarded"] is True
        events.wait_for("task-succeeded", second.id)
        assert second.get(timeout=10) == ["a", 0.0]
        assert state_of(events, second.id) == "SUCCESS"
        # Admitted at once: no event of ours, Celery's own states only.
        events.wait_for("task-succeeded", first.id)
        assert [t for t in events.types(first.id) if t.startswith("task-baton")] == []

        # A rate: the second start of a host within 2 s waits for its slot.
        one, two = fetch.delay("h"), fetch.delay("h")
        held = events.wait_for("task-baton-held", two.id)
        assert held["reason"] == "rate"
        assert held["waiting_for"] == "global_rate_limit of fetch(host='h')"
        assert held["retry_after"] > 0
        admitted = events.wait_for("task-baton-admitted", two.id)
        assert admitted["reason"] == "rate" and 0.5 < admitted["waited"] < 5, admitted
        assert one.get(timeout=10) == ["h", 0.0] and two.get(timeout=10) == ["h", 0.0]


def test_skipped_superseded_debounced_throttled_and_refused_say_why_and_by_whom(
    workers: Workers, broker_url: str
) -> None:
    from tests.apps.events import app, latest, notify, replace_me, save, skip_busy

    workers.start(APP, concurrency=2, extra_args=["-E"])
    with EventCapture(broker_url) as events:
        # Skipped: an exclusive duplicate while the key is held.
        holder = skip_busy.delay("b", 1.5)
        events.wait_for("task-started", holder.id, timeout=20)  # it holds the key
        dup = skip_busy.delay("b", 0.0)
        skipped = events.wait_for("task-baton-skipped", dup.id)
        assert skipped["reason"] == "exclusive"
        assert skipped["holder"] == holder.id
        assert skipped["key"] == "skip_busy(key='b')"
        assert "TaskSkipped" in skipped["exception"] and holder.id in skipped["exception"]
        assert state_of(events, dup.id) == "BATON-SKIPPED"

        # Superseded: keep_last keeps only the newest of the calls that wait.
        running = latest.delay("c", 1, 1.5)
        events.wait_for("task-started", running.id, timeout=20)  # it holds the key
        older = latest.delay("c", 2)
        events.wait_for("task-baton-held", older.id, timeout=20)  # it waits for the key
        newest = latest.delay("c", 3)
        superseded = events.wait_for("task-baton-superseded", older.id)
        assert superseded["replaced_by"] == newest.id
        assert superseded["key"] == "latest(key='c')"
        assert "TaskSuperseded" in superseded["exception"]
        assert state_of(events, older.id) == "BATON-SUPERSEDED"
        assert newest.get(timeout=10) == ["c", 3] and running.get(timeout=10) == ["c", 1]

        # Superseded while it runs: "replace" terminates it; its own worker says by whom.
        replaced = replace_me.delay("r", 1, 30.0)
        events.wait_for("task-started", replaced.id)
        replacing = replace_me.delay("r", 2)
        superseded = events.wait_for("task-baton-superseded", replaced.id)
        assert superseded["replaced_by"] == replacing.id
        assert superseded["key"] == "replace_me(key='r')"
        events.wait_for("task-revoked", replaced.id)
        assert state_of(events, replaced.id) == "BATON-SUPERSEDED"
        assert replacing.get(timeout=15) == ["r", 2]

        # Debounced: a burst runs once, as its last call; the others name it.
        burst = [save.delay("d", n) for n in range(3)]
        last = burst[-1]
        for call in burst[:-1]:
            debounced = events.wait_for("task-baton-debounced", call.id)
            assert debounced["replaced_by"] in {c.id for c in burst[1:]}, debounced
            assert debounced["key"] == "save(doc_id='d')"
        held = events.wait_for("task-baton-held", last.id)
        assert held["reason"] == "debounce"
        assert held["waiting_for"] == "quiet time of save(doc_id='d')"
        assert last.get(timeout=20) == ["d", 2]

        # Throttled: a second call within the window is dropped, naming the run.
        ran = notify.delay("u", 1)
        assert ran.get(timeout=10) == ["u", 1]
        dropped = notify.delay("u", 2)
        throttled = events.wait_for("task-baton-throttled", dropped.id)
        assert throttled["reason"] == "throttled" and throttled["holder"] == ran.id
        assert throttled["key"] == "notify(user='u')"
        assert state_of(events, dropped.id) == "BATON-THROTTLED"

        # Refused: a call whose key cannot be built fails, never runs.
        bad = app.send_task("tests.apps.events.keyed", kwargs={})
        refused = events.wait_for("task-baton-skipped", bad.id)
        assert refused["reason"] == "invalid-key" and "key" in refused["exception"]


def test_handed_back_says_how_long_it_was_held(
    workers: Workers, rabbitmq_url: str, result_url: str
) -> None:
    """On RabbitMQ, where a held message is handed back at the horizon (on Redis its
    claim is renewed instead: tests/transport/test_held_renewal.py)."""
    queue = f"events-{secrets.token_hex(4)}"
    env = {"TEST_BROKER_URL": rabbitmq_url, "EVENTS_QUEUE": queue, "EVENTS_HOLD_HORIZON": "1"}
    publisher = Celery("publisher", broker=rabbitmq_url, backend=result_url, set_as_current=False)
    name = "tests.apps.events.wait_turn"
    try:
        workers.start(APP, concurrency=2, extra_args=["-E"], env=env)
        with EventCapture(rabbitmq_url) as events:
            first = publisher.send_task(
                name, args=("h", 8.0), queue=queue
            )  # seen running when loaded
            events.wait_for("task-started", first.id, timeout=20)  # it holds the key
            second = publisher.send_task(name, args=("h", 0.0), queue=queue)
            events.wait_for("task-baton-held", second.id)
            handed = events.wait_for("task-baton-handed-back", second.id)
            assert "the horizon" in handed["reason"] and handed["waited"] >= 1.0, handed
            # Back from the broker, the same task id waits again and runs once the key
            # is free.
            assert first.get(timeout=30) == ["h", 8.0]
            assert second.get(timeout=30) == ["h", 0.0]
    finally:
        workers.stop_all(timeout=10)
        with contextlib.suppress(Exception), kombu.Connection(rabbitmq_url) as conn:
            conn.default_channel.queue_delete(queue)
        publisher.close()


def test_without_task_events_nothing_is_sent_until_they_are_enabled(
    workers: Workers, broker_url: str
) -> None:
    from tests.apps.events import app, skip_busy, wait_turn

    # No -E, as deployed by default: heartbeats on, so the event dispatcher is enabled,
    # for the "worker" group only (without heartbeats it is off: enable_events cannot
    # turn it on, for Celery's own events neither).
    worker = workers.start(APP, concurrency=2, heartbeat=True)
    with EventCapture(broker_url) as events:
        holder = skip_busy.delay("e", 1.0)
        # A fixed head start for the holder: no task event to wait on, their absence is
        # what this part checks.
        time.sleep(0.3)
        dup = skip_busy.delay("e", 0.0)
        first = wait_turn.delay("f", 1.0)
        time.sleep(0.3)  # the same head start
        waiter = wait_turn.delay("f", 0.0)
        for result in (holder, first, waiter):
            result.get(timeout=10)
        wait_until(lambda: dup.state == "FAILURE", 10, "the duplicate skipped")
        # Not a wait: nothing must arrive, and whatever was sent has arrived by now.
        time.sleep(1.0)
        task_events: list[Any] = [e for e in events.events if e["type"].startswith("task-")]
        assert task_events == []
        assert any(e["type"] == "worker-heartbeat" for e in events.events)  # it does send

        # `celery control enable_events`: the same decision is now sent.
        replies = broadcast(
            app, lambda: app.control.enable_events(destination=[worker.hostname], reply=True)
        )
        assert replies, "the worker did not answer enable_events"
        holder = skip_busy.delay("g", 1.0)
        events.wait_for("task-started", holder.id, timeout=20)  # sent now: it holds the key
        dup = skip_busy.delay("g", 0.0)
        assert events.wait_for("task-baton-skipped", dup.id)["holder"] == holder.id
