"""``celery control rate_limit`` at runtime with ``baton_global_rate_limits`` (issue 11,
item 3).

A task that had no ``rate_limit`` when the workers started must follow one set later
through Celery's own control command, across all workers together (Celery's per-worker
bucket is off for it, so the gate is the only one that can enforce it), and lifting it
again must let the held backlog go. Judged by the observer's start stamps.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.support.observer import Observer
from tests.support.waiting import broadcast, wait_until
from tests.support.workers import Workers

APP = "tests.apps.loop"


def _set_rate(app: Any, task: str, rate: str, workers: int) -> None:
    replies = broadcast(app, lambda: app.control.rate_limit(task, rate, reply=True, timeout=10))
    assert len(replies) == workers, replies
    assert all("ok" in next(iter(reply.values())) for reply in replies), replies


@pytest.mark.timeout(120)  # ~15-30 s here; 60 s is the default
def test_rate_limit_set_at_runtime_holds_across_workers_and_can_be_lifted(
    workers: Workers, observer: Observer
) -> None:
    from tests.apps import loop

    started = [workers.start(APP, wait=False, pool="solo", concurrency=1) for _ in range(2)]
    for worker in started:
        worker.wait_ready()
    assert loop.hit.delay() is not None
    observer.starts_of("hit", 1)  # both workers run it unlimited before the change

    _set_rate(loop.app, loop.hit.name, "6/m", len(started))
    published_at = time.monotonic()
    for _ in range(20):
        loop.hit.delay()
    # Not a wait: the starts are counted over 6 s, at most 2 may come.
    time.sleep(6.0 - (time.monotonic() - published_at))
    starts = len(observer.starts_of("hit", 1)) - 1
    # 6/m with burst 1 over both workers: one start now, the next 10 s later. Celery
    # alone would give each worker its own bucket (2 starts); nobody at all: 20.
    assert starts <= 2, f"{starts} starts in 6 s under a global 6/m"
    assert all(w.is_running for w in started)

    # Lifting the limit frees the backlog held in the consumers (not at 6/m).
    _set_rate(loop.app, loop.hit.name, "0", len(started))
    wait_until(
        lambda: len(observer.started()) >= 21, 30, "the held backlog ran once the limit was lifted"
    )
    assert len(observer.started()) == 21
    assert all("Traceback" not in w.log_text() for w in started)
