"""In-process beat fixtures: a Celery app on the test servers, and a controlled clock."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from typing import Any

import pytest
import redis
from celery import Celery

from celery_baton.beat import Scheduler
from celery_baton.beat.entries import CompiledEntry

UTC = timezone.utc


class Clock:
    """A wall clock the test moves by hand (epoch milliseconds)."""

    def __init__(self, start: datetime) -> None:
        self.ms = int(start.timestamp() * 1000)

    def __call__(self) -> int:
        return self.ms

    def set(self, when: datetime) -> None:
        self.ms = int(when.timestamp() * 1000)

    def advance(self, seconds: float) -> None:
        self.ms += int(seconds * 1000)


class RecordingScheduler(Scheduler):
    """Records what it would publish instead of talking to the broker."""

    sent: list[tuple[str, int, str]]

    def publish(self, compiled: CompiledEntry, slot_ms: int, task_id: str, **options: Any) -> Any:
        self.sent.append((compiled.name, slot_ms, task_id))
        return None


@pytest.fixture
def make_app(store_url: str, broker_url: str, result_url: str) -> Callable[..., Celery]:
    def make(schedule: dict[str, Any], main: str = "beat_inproc", **conf: Any) -> Celery:
        app = Celery(main, broker=broker_url, backend=result_url, set_as_current=False)
        app.conf.update({"baton_url": store_url, "timezone": "UTC", "result_expires": None, **conf})
        app.conf.beat_schedule = schedule

        @app.task(name="t.tick", shared=False)
        def tick(*args: Any) -> None:
            pass

        return app

    return make


@pytest.fixture
def clock() -> Clock:
    return Clock(datetime(2026, 6, 1, 9, 0, tzinfo=UTC))


@pytest.fixture
def schedulers() -> Iterator[Callable[..., RecordingScheduler]]:
    """Build RecordingSchedulers sharing one ``sent`` list; all are closed at the end."""
    made: list[RecordingScheduler] = []
    sent: list[tuple[str, int, str]] = []

    def build(app: Celery, clock: Clock) -> RecordingScheduler:
        s = RecordingScheduler(app, clock=clock)
        s.sent = sent
        made.append(s)
        return s

    build.sent = sent  # type: ignore[attr-defined]
    yield build
    for s in made:
        s.close()


@pytest.fixture
def store(store_server: Any, store_url: str) -> Iterator[redis.Redis]:
    """A client of the store under test (closed at the end)."""
    with store_server.client() as client:
        yield client
