"""What the in-process Scheduler tests share (tests/beat/test_scheduler_*.py): a tick
that renews now, a slot in milliseconds, an entry of the test app's ``t.tick``."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from celery import Celery

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
