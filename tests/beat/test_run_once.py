"""A beat slot runs once end to end, even when it is *sent* twice (issue 11, item 6).

A broker cannot be fenced: a leader that blocks in the broker's publish while its lease
runs out still sends its message when the broker comes back, and the next leader has
re-sent the same slot from the outbox meanwhile, under the same task id. Both messages
land; the worker must run the slot once. The beat stamps its messages with the slot
(``baton_beat_slot``); the worker admits such a task id once, whatever the task's own
options (``beat.record`` has none) and without ``baton_redelivery_guard``.

Runs are counted by the observer, outside the library, keyed ``<app>:<entry>|<slot>``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter
from datetime import datetime, timezone
from typing import Any

import pytest

from tests.beat.helpers import wait_for_leading_log
from tests.support.observer import Observer
from tests.support.servers import StoreServer
from tests.support.workers import Workers

ALPHA = "tests.apps.beat_alpha"


def _settle(observer: Observer, quiet: float = 3.0, timeout: float = 40.0) -> None:
    """Wait until no run started or ended for ``quiet`` seconds."""
    deadline = time.monotonic() + timeout
    seen = (-1, -1)
    while time.monotonic() < deadline:
        now = (len(observer.started()), len(observer.runs()))
        if now == seen:
            return
        seen = now
        time.sleep(quiet)


def test_one_slot_sent_twice_runs_once(workers: Workers, observer: Observer) -> None:
    """What two leaders do after a broker stall: the same slot's message twice (same
    task id, same beat headers), both delivered while the first copy runs, then a
    third copy that comes late, after the run finished. The slot runs once; another
    slot of the entry and a plain message of the same task are not affected."""
    from tests.apps import beat_alpha

    workers.start(ALPHA, concurrency=2)
    slot = 1_780_000_000_000

    def send(slot_ms: int, task_id: str) -> None:
        headers = {"celery_beat_task": True, "baton_beat_entry": "e", "baton_beat_slot": slot_ms}
        beat_alpha.record.apply_async(("e", 1.5), task_id=task_id, headers=headers)

    task_id = str(uuid.uuid4())
    send(slot, task_id)
    send(slot, task_id)  # lands while the first copy runs
    observer.runs_of(f"alpha:e|{slot}", 1, timeout=30)
    send(slot, task_id)  # lands after the first copy finished
    send(slot + 1000, str(uuid.uuid4()))  # the next slot: runs
    beat_alpha.record.delay("plain", 0.0)  # not from beat: untouched
    observer.runs_of(f"alpha:e|{slot + 1000}", 1, timeout=30)
    observer.runs_of("alpha:plain|None", 1, timeout=30)
    _settle(observer)

    starts = [s for s in observer.started() if s["key"] == f"alpha:e|{slot}"]
    assert len(starts) == 1, f"slot {slot} ran {len(starts)} times: {starts}"
    assert starts[0]["task_id"] == task_id


@pytest.mark.timeout(120)  # ~15-30 s here; 60 s is the default
def test_broker_stall_two_beats_no_slot_runs_twice(
    workers: Workers, observer: Observer, broker_server: StoreServer
) -> None:
    """Two real beats (lease 3 s) and a worker; the broker is SIGSTOPped for 8 s. The
    leader blocks in its publish, loses its lease, the other beat takes over and
    re-sends the claimed slot from the outbox; when the broker comes back both copies
    land. Every slot runs once."""
    env = {"BATON_BEAT_LEASE_TTL": "3"}
    worker = workers.start(ALPHA, env=env, concurrency=4)
    beats = [workers.start_beat(ALPHA, env=env, wait=False) for _ in range(2)]
    for beat in beats:
        beat.wait_started()
    wait_for_leading_log(beats)
    time.sleep(4)
    broker_server.pause()
    try:
        time.sleep(8)
    finally:
        broker_server.resume()
    time.sleep(6)
    for beat in beats:
        beat.stop()
    _settle(observer)

    logs = "".join(beat.log_text() for beat in beats)
    # The duplicate was really sent (else this proves nothing).
    assert "re-sending 'every1'" in logs or "re-sending 'alpha_only'" in logs, logs[-4000:]
    counts: dict[str, int] = {}
    for start in observer.started():
        counts[start["key"]] = counts.get(start["key"], 0) + 1
    twice = {key: n for key, n in counts.items() if n > 1}
    assert not twice, f"slots run more than once: {twice}"
    assert sum(1 for key in counts if key.startswith("alpha:every1|")) >= 10, counts
    # The worker dropped the copy (else both copies did not land: this proves nothing).
    assert "already finished" in worker.log_text(), worker.log_tail()


@pytest.mark.timeout(180)
def test_slots_that_ran_leave_one_key_per_entry(
    workers: Workers, observer: Observer, store_server: StoreServer
) -> None:
    """Issue 28, item 12: a beat (in this process, its clock moved 1 s per tick) fires
    two entries of 1 s and 2 s for 150 simulated seconds to a real worker. Every slot
    runs once, and the store keeps one record per entry of the slots that ran (before:
    a done marker per slot for a day, 225 keys here). A copy of an early slot, re-sent
    from the outbox as a new leader would, is still refused."""
    from celery_baton.beat import Scheduler, slot_task_id
    from tests.apps import beat_alpha
    from tests.beat.conftest import Clock

    sent: list[tuple[str, int, str]] = []

    class Sending(Scheduler):  # type: ignore[misc]
        def publish(self, compiled: Any, slot_ms: int, task_id: str, **options: Any) -> Any:
            sent.append((compiled.name, slot_ms, task_id))
            return super().publish(compiled, slot_ms, task_id, **options)

    worker = workers.start(ALPHA, concurrency=2)
    clock = Clock(datetime.now(timezone.utc))
    beat = Sending(beat_alpha.app, clock=clock)
    try:
        for _ in range(150):
            beat.leader.renew_at = 0.0  # lead (and renew) on every tick
            beat.tick()
            clock.advance(1)
        every1 = [slot for name, slot, _ in sent if name == "every1"]
        assert len(every1) >= 140, sent[-5:]
        observer.runs_of(f"alpha:every1|{every1[-1]}", 1, timeout=60)
        _settle(observer)
        counts = Counter(start["key"] for start in observer.started())
        assert len(counts) == len(sent) and set(counts.values()) == {1}, counts.most_common(3)

        with store_server.client() as store:
            keys = sorted(store.scan_iter(match="baton:{beat.record}:*", count=10_000))
            # A run lease's words (`locks`) live as long as the lease: not a key per slot.
            kept = [key for key in keys if ":label:" not in key]
            assert len(kept) <= 4, f"{len(kept)} keys: {kept[:6]}"  # 2 records, epochs
            assert all(store.pttl(key) <= 30_000 for key in keys if ":label:" in key)

            # The leader that claimed every1's 6th slot died before clearing its outbox.
            slot, before = every1[5], every1[4]
            task_id = slot_task_id("baton", "every1", slot, app="alpha")
            item = {"entry": "every1", "slot": slot, "kind": "fired", "before": before}
            store.hset(beat._beat.keys.outbox, task_id, json.dumps(item))
        beat._resend_outbox()
        deadline = time.monotonic() + 30
        while "already finished" not in worker.log_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "already finished" in worker.log_text(), worker.log_tail()
        assert [s["key"] for s in observer.started()].count(f"alpha:every1|{slot}") == 1
    finally:
        beat.close()
