"""An entry's policies and settings: misfire, overlap, time zones, refused entries,
the history's bound.

The Scheduler in-process against the real store, with a controlled clock. Publishing is
recorded instead of sent (``RecordingScheduler``); real beat processes and workers are in
test_processes.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime

import pytest
import redis
from celery import Celery
from celery.schedules import crontab

from celery_baton.beat import describe_schedule
from tests.beat.conftest import Clock
from tests.beat.scheduler_helpers import UTC, Build, entry, ms, tick


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
