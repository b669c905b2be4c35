"""The Scheduler in-process against the real store, with a controlled clock.

Publishing is recorded instead of sent (``RecordingScheduler``); real beat processes
and workers are in test_processes.py.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import redis
from celery import Celery
from celery.schedules import crontab

from celery_baton.beat import ScheduleStore, describe_schedule, slot_task_id
from celery_baton.errors import BeatEntryError
from tests.beat.conftest import Clock, RecordingScheduler

UTC = timezone.utc
Build = Callable[[Celery, Clock], RecordingScheduler]


def tick(s: RecordingScheduler) -> float:
    s.leader.renew_at = 0.0  # renew (and notice store changes) on this tick, not 2 s later
    return s.tick()


def ms(when: datetime) -> int:
    return int(when.timestamp() * 1000)


def entry(schedule: Any, **options: Any) -> dict[str, Any]:
    return {"task": "t.tick", "schedule": schedule, "options": options}


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


@pytest.mark.parametrize(("policy", "fired"), [("skip", 0), ("latest", 1), ("all", 10)])
def test_misfire_policy_after_downtime(
    make_app: Callable[..., Celery], clock: Clock, schedulers: Build, policy: str, fired: int
) -> None:
    clock.set(datetime(2026, 6, 1, 9, 0, 30, tzinfo=UTC))
    app = make_app({"m": entry(crontab(), baton_misfire=policy, baton_misfire_grace=20)})
    s = schedulers(app, clock)
    tick(s)
    s.close()
    clock.set(datetime(2026, 6, 1, 9, 10, 40, tzinfo=UTC))  # 09:01..09:10 passed, all late
    s = schedulers(app, clock)
    tick(s)
    assert len(s.sent) == fired
    if fired:
        assert s.sent[-1][1] == ms(datetime(2026, 6, 1, 9, 10, tzinfo=UTC))
    (m,) = describe_schedule(s._store, app="beat_inproc")["entries"]  # type: ignore[arg-type]
    assert m["missed"] == 10 - fired
    assert m["next_slot"] == "2026-06-01T09:11:00.000Z"
    missed_lines = [line for line in m["history"] if line["kind"] == "missed"]
    assert [line["count"] for line in missed_lines] == ([10 - fired] if fired < 10 else [])


def test_misfire_all_is_bounded(
    make_app: Callable[..., Celery], clock: Clock, schedulers: Build
) -> None:
    app = make_app({"s": entry(1.0, baton_misfire="all", baton_misfire_max=50)})
    s = schedulers(app, clock)
    tick(s)
    s.close()
    clock.advance(3600)
    s = schedulers(app, clock)
    tick(s)
    assert len(s.sent) == 50
    (e,) = describe_schedule(s._store, app="beat_inproc")["entries"]  # type: ignore[arg-type]
    assert e["missed"] == 3600 - 50


def test_overlap_skip_while_previous_run_unfinished(
    make_app: Callable[..., Celery], clock: Clock, schedulers: Build
) -> None:
    app = make_app({"o": entry(10.0, baton_overlap="skip")})
    s = schedulers(app, clock)
    tick(s)
    clock.advance(10)
    tick(s)
    assert len(s.sent) == 1
    clock.advance(10)
    tick(s)  # the first run never ran (PENDING): suppressed
    assert len(s.sent) == 1
    app.backend.store_result(s.sent[0][2], None, "SUCCESS")
    clock.advance(10)
    tick(s)
    assert len(s.sent) == 2
    (o,) = describe_schedule(s._store, app="beat_inproc")["entries"]  # type: ignore[arg-type]
    assert o["suppressed"] == 1
    assert any(line["kind"] == "suppressed" for line in o["history"])


def test_runtime_api(
    make_app: Callable[..., Celery],
    clock: Clock,
    schedulers: Build,
    request: pytest.FixtureRequest,
) -> None:
    # cfg must not come due by itself in this test: the clock jumps to the server's time
    # below, and an hourly entry fired whenever the test ran in the 2 minutes before a
    # full hour (seen in CI).
    app = make_app({"cfg": entry(10_000_000.0)})
    s = schedulers(app, clock)
    tick(s)
    api = ScheduleStore(app)
    request.addfinalizer(api.close)
    api.add("dyn", "t.tick", 30, args=[1], options={"baton_misfire": "latest"})
    with pytest.raises(BeatEntryError, match="already exists"):
        api.add("dyn", "t.tick", 30)
    with pytest.raises(BeatEntryError, match="beat_schedule"):
        api.update("cfg", schedule=10)
    with pytest.raises(BeatEntryError, match="'bad'"):
        api.add("bad", "t.tick", "61 * * * *")
    with pytest.raises(BeatEntryError, match="unknown task"):
        api.add("ghost", "no.such.task", 10)
    with pytest.raises(BeatEntryError, match="> 0"):
        api.add("zero", "t.tick", 0)
    tick(s)
    listing = {e["name"]: e for e in api.describe()["entries"]}
    assert listing["dyn"]["source"] == "api"
    assert listing["dyn"]["policy"]["misfire"] == "latest"
    server_next = listing["dyn"]["next_slot"]
    assert server_next is not None
    # The API computed the slot from the server's clock; align the test clock on it.
    clock.ms = int(datetime.fromisoformat(server_next.replace("Z", "+00:00")).timestamp() * 1000)
    tick(s)
    assert [n for n, _, _ in s.sent] == ["dyn"]

    api.pause("dyn")
    tick(s)
    clock.advance(120)
    tick(s)
    assert len(s.sent) == 1
    api.resume("dyn")
    tick(s)
    assert len(s.sent) == 1  # resumed from now: paused slots are not run
    api.trigger("cfg")
    tick(s)
    assert [n for n, _, _ in s.sent] == ["dyn", "cfg"]
    api.update("dyn", schedule=crontab(minute=0, hour=0))
    tick(s)
    api.remove("dyn")
    tick(s)
    listing = {e["name"]: e for e in api.describe()["entries"]}
    assert set(listing) == {"cfg"}
    described = api.describe()
    assert described["leader"]["owner"] == s.owner
    assert described["leader"]["lease_age_s"] >= 0


def test_bad_entries_are_refused_and_others_run(
    make_app: Callable[..., Celery], clock: Clock, schedulers: Build
) -> None:
    app = make_app(
        {
            "zero": entry(0.0),
            "ghost": {"task": "no.such.task", "schedule": 5.0},
            "badpolicy": entry(5.0, baton_misfire="sometimes"),
            "badzone": entry(crontab(), baton_timezone="Mars/Olympus"),
            "good": entry(5.0),
        }
    )
    s = schedulers(app, clock)
    tick(s)
    clock.advance(5)
    tick(s)
    assert [n for n, _, _ in s.sent] == ["good"]
    refused = describe_schedule(s._store, app="beat_inproc")["refused"]  # type: ignore[arg-type]
    assert set(refused) == {"zero", "ghost", "badpolicy", "badzone"}
    assert "unknown task 'no.such.task'" in refused["ghost"]
    assert "> 0" in refused["zero"]


def test_time_zone_per_entry_and_app(
    make_app: Callable[..., Celery], clock: Clock, schedulers: Build
) -> None:
    app = make_app(
        {
            "berlin": entry(crontab(minute=0, hour=9), baton_timezone="Europe/Berlin"),
            "app_tz": entry(crontab(minute=0, hour=9)),
        },
        timezone="Asia/Kolkata",
    )
    clock.set(datetime(2026, 6, 1, 0, 0, tzinfo=UTC))
    s = schedulers(app, clock)
    tick(s)
    listing = {e["name"]: e for e in describe_schedule(s._store, app="beat_inproc")["entries"]}  # type: ignore[arg-type]
    assert listing["berlin"]["next_slot"] == "2026-06-01T07:00:00.000Z"  # 09:00 CEST
    assert listing["app_tz"]["next_slot"] == "2026-06-01T03:30:00.000Z"  # 09:00 IST


def test_history_is_bounded(
    make_app: Callable[..., Celery], clock: Clock, schedulers: Build, store_url: str
) -> None:
    app = make_app({"h": entry(1.0)}, baton_beat_history=5)
    s = schedulers(app, clock)
    tick(s)
    for _ in range(12):
        clock.advance(1)
        tick(s)
    with redis.Redis.from_url(store_url) as r:
        lines = r.lrange("baton:{beat:beat_inproc}:history:h", 0, -1)
    assert len(lines) == 5
    assert json.loads(lines[0])["kind"] == "fired"


def test_store_data_lost_beat_goes_on_without_duplicates(
    make_app: Callable[..., Celery], clock: Clock, schedulers: Build, store_url: str
) -> None:
    """A store restarted empty (no persistence): entries are redefined from now."""
    s = schedulers(make_app({"e": entry(5.0)}), clock)
    tick(s)
    for _ in range(3):
        clock.advance(5)
        tick(s)
    with redis.Redis.from_url(store_url) as r:
        r.flushall()
    for _ in range(4):
        clock.advance(5)
        tick(s)
    slots = [slot for _, slot, _ in s.sent]
    assert len(slots) == len(set(slots)) >= 5
    assert slots == sorted(slots)


def test_a_claim_the_store_lost_is_written_back_not_sent_again(
    make_app: Callable[..., Celery], clock: Clock, schedulers: Build, store_url: str
) -> None:
    """The store loses the leader's last claim but keeps the rest (a master change to a
    replica that was behind; a planned Sentinel failover, the old master writable a
    moment longer): the entry's next slot is one this beat already sent. It writes its
    claim back instead of sending that slot again."""
    s = schedulers(make_app({"e": entry(5.0)}), clock)
    tick(s)
    key = "baton:{beat:beat_inproc}:entry:e"
    with redis.Redis.from_url(store_url, decode_responses=True) as r:
        for _ in range(3):
            before = r.hget(key, "next")
            clock.advance(5)
            tick(s)
        assert r.hget(key, "next") != before
        r.hset(key, "next", before)  # the last claim is gone
        for _ in range(4):
            clock.advance(5)
            tick(s)
        history = [
            json.loads(line) for line in r.lrange("baton:{beat:beat_inproc}:history:e", 0, -1)
        ]
    slots = [slot for _, slot, _ in s.sent]
    assert len(slots) == len(set(slots)) >= 6, slots
    assert slots == sorted(slots)
    restored = [h for h in history if h["kind"] == "restored"]
    assert [(h["from"], h["next"]) for h in restored] == [(int(before), int(before) + 5000)]


def test_store_down_fires_nothing_and_resumes(
    make_app: Callable[..., Celery], clock: Clock, schedulers: Build, store_server: Any
) -> None:
    s = schedulers(make_app({"e": entry(1.0)}), clock)
    tick(s)
    clock.advance(1)
    tick(s)
    store_server.stop()
    try:
        for _ in range(3):
            clock.advance(1)
            assert tick(s) > 0  # logs and retries; no exception escapes
        assert len(s.sent) == 1  # nothing fired unclaimed
    finally:
        store_server.start()
    clock.advance(1)
    tick(s)
    tick(s)
    slots = [slot for _, slot, _ in s.sent]
    assert len(slots) == len(set(slots)) == 5  # the down time's slots caught up (grace)


def test_now_follows_the_store_clock_not_the_host_wall_clock(
    make_app: Callable[..., Celery], store: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A jump of the host's wall clock moves neither "now" nor the slots (no burst)."""
    s = RecordingScheduler(make_app({"e": entry(1.0)}))
    s.sent = []
    try:
        s.tick()
        real_time = time.time
        monkeypatch.setattr(time, "time", lambda: real_time() + 3600)
        seconds, micros = store.time()
        server_ms = int(seconds) * 1000 + int(micros) // 1000
        assert abs(s.now_ms() - server_ms) < 1000
        s.tick()
        assert s.sent == []  # the entry's first slot is 1 s away, not an hour ago
    finally:
        s.close()


def test_a_claim_refused_by_a_change_says_what_changed(
    make_app: Callable[..., Celery],
    clock: Clock,
    schedulers: Build,
    request: pytest.FixtureRequest,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An entry paused after this beat last read the store: the log line names the
    change (it was paused), not the claim script's status number."""
    app = make_app({"every": entry(10.0)})
    s = schedulers(app, clock)
    tick(s)
    api = ScheduleStore(app)
    request.addfinalizer(api.close)
    api.pause("every")
    clock.advance(11)
    with caplog.at_level("INFO"):
        s.tick()  # not tick(s): the beat has not noticed the pause yet and claims
    lines = [r.getMessage() for r in caplog.records if "changed in the store" in r.getMessage()]
    assert lines == ["beat: entry 'every' changed in the store (it was paused); reloading"]
    assert s.sent == []
