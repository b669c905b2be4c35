"""A plain Celery app (no celery-baton) for testing the test infrastructure itself.

Run by workers as ``celery -A tests.apps.basic worker``; reads ``TEST_BROKER_URL``,
``TEST_RESULT_URL`` and ``TEST_OBSERVER_URL`` from the environment (see
``tests.support.workers.app_env``). In the test process, import it inside a test that
uses the ``app_environ`` fixture (or any fixture built on it), which sets those variables.
"""

from __future__ import annotations

import functools
import os

from celery import Celery, Task

from tests.support.observer import Observer

app = Celery(
    "basic",
    broker=os.environ["TEST_BROKER_URL"],
    backend=os.environ.get("TEST_RESULT_URL"),
)
app.conf.update(
    task_acks_late=False,
    worker_prefetch_multiplier=1,
    broker_transport_options={"visibility_timeout": 3600},
    broker_connection_retry_on_startup=True,
)


@functools.cache
def observer() -> Observer:
    """This process's Observer (created after the pool forked, so never shared)."""
    return Observer(os.environ["TEST_OBSERVER_URL"])


@app.task
def noop() -> None:
    """Does nothing."""


@app.task(bind=True)
def observed(self: Task, key: str, sleep: float = 0.0) -> None:
    """One observed run of ``key`` lasting ``sleep`` seconds."""
    observer().run(key, sleep=sleep, task_id=self.request.id)
