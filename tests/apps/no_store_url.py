"""An app that names no store: no ``baton_url``, no ``Baton(app, url=...)`` (and its
tests unset ``$BATON_URL``). Where its store is comes from the broker alone.

Reads ``TEST_BROKER_URL`` and ``TEST_OBSERVER_URL``. :func:`ex_wait` records each run with
the observer (its own server and clock), which judges overlaps.
"""

from __future__ import annotations

from celery import Task

from celery_baton import fence
from tests.apps.factory import make_baton_app, observer

app, baton = make_baton_app("no_store_url", results=False, store_from_env=False)


@app.task(bind=True, exclusive="key", exclusive_conflict="wait")
def ex_wait(self: Task, key: str, sleep: float = 0.0) -> None:
    """One observed run of ``key``; a duplicate waits in the consumer."""
    observer().run(key, fence(), sleep=sleep, task_id=self.request.id)
