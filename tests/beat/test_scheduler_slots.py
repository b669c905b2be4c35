"""Each slot fires once: across restarts and schedule edits, with two leaders, and
for two apps on one store.

The Scheduler in-process against the real store, with a controlled clock. Publishing is
recorded instead of sent (``RecordingScheduler``); real beat processes and workers are in
test_processes.py.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable
from datetime import datetime, timedelta

import redis
from celery import Celery
from celery.schedules import crontab

from celery_baton.beat import describe_schedule, slot_task_id
from tests.beat.conftest import Clock
from tests.beat.scheduler_helpers import UTC, Build, entry, ms, tick


def test_seed_moved_crontab_does_not_fire_at_restart(
    make_app: Callable[..., Celery], clock: Clock, schedulers: Build
) -> None:
    """10:00 moved to 10:30 at 11:00: no run at 11:00; the next run is tomorrow 10:30."""
    day = datetime(2026, 6, 1, tzinfo=UTC)
    clock.set(day.replace(hour=9))
    s1 = schedulers(make_app({"report": entry(crontab(minute=0, hour=10))}), clock)
    tick(s1)
    clock.set(day.replace(hour=10, second=1))
    tick(s1)
    assert [(n, slot) for n, slot, _ in s1.sent] == [("report", ms(day.replace(hour=10)))]
    clock.set(day.replace(hour=11))
    tick(s1)
    s1.close()

    # Celery's own computation from last_run_at says "due" here: the seed's bug.
    moved = crontab(minute=30, hour=10, nowfun=lambda: day.replace(hour=11))
    assert moved.is_due(day.replace(hour=10)).is_due

    s2 = schedulers(make_app({"report": entry(crontab(minute=30, hour=10))}), clock)
    for _ in range(3):
        tick(s2)
        clock.advance(60)
    assert len(s2.sent) == 1  # only 10:00 from before
    listing = describe_schedule(s2._store, "baton", app="beat_inproc")  # type: ignore[arg-type]
    (report,) = listing["entries"]
    assert report["next_slot"] == "2026-06-02T10:30:00.000Z"
    assert report["history"][0]["kind"] == "edited"
    clock.set(day + timedelta(days=1, hours=10, minutes=30, seconds=1))
    tick(s2)
    assert s2.sent[-1][1] == ms(day + timedelta(days=1, hours=10, minutes=30))
    assert len(s2.sent) == 2


def test_restarted_twenty_times_with_unchanged_schedule_no_extra_runs(
    make_app: Callable[..., Celery], clock: Clock, schedulers: Build
) -> None:
    schedule = {"minutely": entry(crontab()), "every7": entry(7.0)}
    start = clock.ms
    rng = random.Random(4)
    for _ in range(20):
        s = schedulers(make_app(schedule), clock)
        for _ in range(rng.randint(0, 3)):
            tick(s)
            clock.advance(rng.uniform(0, 9))
        s.close()  # a clean stop; a restart at any moment in the slot cycle
        clock.advance(rng.uniform(0, 5))
    s = schedulers(make_app(schedule), clock)
    tick(s)
    sent: list[tuple[str, int, str]] = s.sent
    per_slot = Counter((name, slot) for name, slot, _ in sent)
    assert all(n == 1 for n in per_slot.values()), per_slot
    minutes = sorted(slot for name, slot in per_slot if name == "minutely")
    assert minutes == list(range(minutes[0], minutes[-1] + 60_000, 60_000))
    assert minutes[0] == (start // 60_000 + 1) * 60_000  # the first slot after start
    sevens = sorted(slot for name, slot in per_slot if name == "every7")
    assert sevens == list(range(start + 7000, clock.ms + 1, 7000))
    assert {task_id for _, _, task_id in sent} == {
        slot_task_id("baton", name, slot, app="beat_inproc") for name, slot, _ in sent
    }


def test_two_leaders_never_fire_one_slot_twice(
    make_app: Callable[..., Celery], clock: Clock, schedulers: Build, store_url: str
) -> None:
    app = make_app({"every1": entry(1.0)})
    a, b = schedulers(app, clock), schedulers(app, clock)
    tick(a)
    tick(b)
    assert a.leading and not b.leading
    for _ in range(10):
        clock.advance(1)
        tick(a)
        tick(b)
    # a's lease vanishes (as if it stalled past its ttl): b takes over; a, still
    # believing it leads until it renews, cannot claim with its old fence.
    with redis.Redis.from_url(store_url) as r:
        r.delete("baton:{beat:beat_inproc}:leader")
    tick(b)
    assert b.leading
    clock.advance(1)
    a.leader.lease_until = float("inf")
    a._fire_due(clock.ms)
    tick(b)
    for _ in range(5):
        clock.advance(1)
        tick(b)
        tick(a)
    sent = Counter(slot for _, slot, _ in a.sent)
    assert all(n == 1 for n in sent.values())
    assert len(sent) == 16


def test_edit_recomputes_from_now_and_new_entries_start_at_next_slot(
    make_app: Callable[..., Celery], clock: Clock, schedulers: Build
) -> None:
    s = schedulers(make_app({"a": entry(60.0)}), clock)
    tick(s)
    s.close()
    clock.advance(90)  # a's slot (t+60) passed while beat was down: within grace
    s = schedulers(make_app({"a": entry(100.0), "b": entry(crontab(minute="*/5"))}), clock)
    tick(s)
    assert s.sent == []  # edited: no immediate run of the passed slot
    listing = {e["name"]: e for e in describe_schedule(s._store, app="beat_inproc")["entries"]}  # type: ignore[arg-type]
    now = clock.ms
    assert listing["a"]["next_slot"] == _iso(now + 100_000)
    assert listing["b"]["next_slot"] == _iso((now // 300_000 + 1) * 300_000)
    s.close()
    s = schedulers(make_app({"b": entry(crontab(minute="*/5"))}), clock)  # a removed
    tick(s)
    names = [e["name"] for e in describe_schedule(s._store, app="beat_inproc")["entries"]]  # type: ignore[arg-type]
    assert names == ["b"]
    clock.advance(200)
    tick(s)
    assert {n for n, _, _ in s.sent} <= {"b"}


def test_apps_on_one_store_keep_apart_and_never_remove_each_others_entries(
    make_app: Callable[..., Celery], clock: Clock, schedulers: Build, store: redis.Redis
) -> None:
    """Two apps (two projects) on one store, default key prefix: each leads its own
    schedule, the same entry name fires in both under different task ids, and an entry
    another app defined is never removed, even if it sits under this app's keys."""
    a = schedulers(make_app({"x": entry(60.0), "a_only": entry(60.0)}, main="proj_a"), clock)
    b = schedulers(make_app({"x": entry(60.0)}, main="proj_b"), clock)
    tick(a)
    tick(b)
    assert a.leading and b.leading
    clock.advance(61)
    tick(a)
    tick(b)
    fired = Counter(name for name, _, _ in a.sent)
    assert fired == {"x": 2, "a_only": 1}, a.sent
    ids = {task_id for name, _, task_id in a.sent if name == "x"}
    assert len(ids) == 2  # one slot, two apps: two ids (a worker runs each id once)
    assert store.smembers("baton:{beat:proj_a}:names") == {"x", "a_only"}
    assert store.smembers("baton:{beat:proj_b}:names") == {"x"}
    assert store.hget("baton:{beat:proj_a}:entry:x", "app") == "proj_a"

    # Two names that met: an entry under proj_a's keys that another app defined.
    ghost = "baton:{beat:proj_a}:entry:ghost"
    store.hset(ghost, mapping={"source": "config", "app": "proj_z", "next": "1", "fp": "f"})
    store.sadd("baton:{beat:proj_a}:names", "ghost")
    store.incr("baton:{beat:proj_a}:version")
    clock.advance(10)
    time.sleep(a.ttl / 3 + 0.1)  # the next lease renewal reads the version
    tick(a)
    assert store.exists(ghost)
    assert a._beat is not None
    assert a._beat.remove(owner=a.owner, fence=a.leader.fence, name="ghost", source="config") == -4
    assert store.exists(ghost)


def _iso(value: int) -> str:
    when = datetime.fromtimestamp(value / 1000, UTC)
    return when.strftime("%Y-%m-%dT%H:%M:%S.") + f"{value % 1000:03d}Z"
