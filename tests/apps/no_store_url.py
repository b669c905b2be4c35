"""An app that names no store: no ``baton_url``, no ``Baton(app, url=...)`` (and its
tests unset ``$BATON_URL``). Where its store is comes from the broker alone.

Reads ``TEST_BROKER_URL`` and ``TEST_OBSERVER_URL``. :func:`ex_wait` records each run with
the observer (its own server and clock), which judges overlaps.
"""

from __future__ import annotations

import functools
import os

from celery import Celery, Task

from celery_baton import Baton, fence
from tests.support.observer import Observer

app = Celery("no_store_url", broker=os.environ["TEST_BROKER_URL"])
app.conf.update(broker_connection_retry_on_startup=True)
baton = Baton(app)


@functools.cache
def observer() -> Observer:
    """This process's Observer (created after the pool forked, so never shared)."""
    return Observer(os.environ["TEST_OBSERVER_URL"])


@app.task(bind=True, exclusive="key", exclusive_conflict="wait")
def ex_wait(self: Task, key: str, sleep: float = 0.0) -> None:
    """One observed run of ``key``; a duplicate waits in the consumer."""
    observer().run(key, fence(), sleep=sleep, task_id=self.request.id)
