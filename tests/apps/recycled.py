"""A Celery app for pools whose processes are recycled (``--max-tasks-per-child``) and
tasks with time limits: what a worker hands its pool, judged at the task body's start.

Issue 34 §1-2. Each task reports its start to the
:class:`~tests.support.observer.Observer` (its own server's clock), so a test judges
every limit where the user meets it.

Reads ``TEST_BROKER_URL``, ``TEST_OBSERVER_URL`` and ``BATON_URL``; and
``RECYCLED_SLOW_EXIT``: seconds a leaving pool process takes to exit (its
``worker_process_shutdown`` handler sleeps, as one closing connections or flushing
metrics may).
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Task, signals

from tests.apps.factory import make_baton_app, observer

app, baton = make_baton_app("recycled", results=False, task_ignore_result=True)

#: At most this many ``capped`` runs anywhere.
CAPPED = 2
#: The throttle's window (s): at most one start in it.
THROTTLE = 2.0
#: The timed tasks' rate: one start a second.
RATE = "1/s"
#: The timed tasks' limit (s): far longer than the body (milliseconds), shorter than a
#: wait for the third token in line.
LIMIT = 1.0


_SLOW_EXIT = float(os.environ.get("RECYCLED_SLOW_EXIT", "0"))
if _SLOW_EXIT:

    @signals.worker_process_shutdown.connect(weak=False)
    def _exit_slowly(**_: Any) -> None:
        time.sleep(_SLOW_EXIT)


@app.task(bind=True, global_concurrency=1)
def alone(self: Task, sleep: float) -> None:
    """At most one running anywhere."""
    observer().run("alone", sleep=sleep, task_id=self.request.id)


@app.task(bind=True, global_concurrency=CAPPED)
def capped(self: Task, sleep: float) -> None:
    """At most ``CAPPED`` running anywhere."""
    observer().run("capped", sleep=sleep, task_id=self.request.id)


@app.task(bind=True, throttle=THROTTLE)
def throttled(self: Task, n: int) -> None:
    """One start per window; the others within it are dropped."""
    observer().run("throttled", task_id=self.request.id)


@app.task(bind=True, global_rate_limit=RATE)
def rated(self: Task, n: int) -> None:
    """1/s."""
    observer().run("rated", task_id=self.request.id)


@app.task(bind=True, global_rate_limit=RATE, soft_time_limit=LIMIT)
def soft_limited(self: Task, n: int) -> None:
    """1/s, with a soft time limit."""
    observer().run("soft_limited", task_id=self.request.id)


@app.task(bind=True, global_rate_limit=RATE, time_limit=LIMIT)
def hard_limited(self: Task, n: int) -> None:
    """1/s, with a hard time limit."""
    observer().run("hard_limited", task_id=self.request.id)
