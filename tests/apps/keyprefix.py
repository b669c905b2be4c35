"""A Celery app whose Redis broker keys carry kombu's ``global_keyprefix`` (a broker
shared by several apps): every key the worker and celery-baton read or write on the
broker must carry it too.

Run by workers as ``celery -A tests.apps.keyprefix worker``. Reads ``TEST_BROKER_URL``,
``TEST_RESULT_URL``, ``TEST_OBSERVER_URL`` and ``BATON_URL`` from the environment. In
the test process, import it inside a test that uses the ``app_environ`` fixture.
"""

from __future__ import annotations

import time

from celery import Task

from tests.apps.factory import fenced_run, make_baton_app

#: What kombu puts before every broker key of this app.
PREFIX = "app1:"

app, baton = make_baton_app(
    "keyprefix",
    broker_transport_options={"global_keyprefix": PREFIX, "visibility_timeout": 3600},
    worker_lost_wait=1.0,
)


@app.task(bind=True, exclusive="key")
def ex_skip(self: Task, key: str, sleep: float = 0.0) -> int:
    """One observed run of ``key``; a duplicate is skipped."""
    return fenced_run(self, key, sleep)


@app.task(bind=True, unique="key")
def uq_quick(self: Task, key: str) -> str:
    """Unique: returns its own id at once."""
    return str(self.request.id)


@app.task
def sleeper(seconds: float) -> None:
    """Keeps a pool process busy for ``seconds``."""
    time.sleep(seconds)
