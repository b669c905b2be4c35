"""A new user's project: celery-baton with every default, a beat on its Scheduler.

Nothing is tuned for the tests (Celery's prefetch, early acks, the default
``lease_ttl`` and socket timeout): what a user who follows the README gets. Reads
``TEST_BROKER_URL``, ``TEST_RESULT_URL``, ``TEST_OBSERVER_URL`` and ``BATON_URL`` (the
store: resolved by celery-baton itself from the environment), and:

* ``FIRST_RUN_BEAT`` -- JSON ``{name: {"every": seconds, "options": {...}}}``: entries
  running :func:`tick`;
* ``FIRST_RUN_LEASE_TTL`` -- ``baton_lease_ttl`` (unset: the default).
"""

from __future__ import annotations

import functools
import json
import os

from celery import Celery, Task
from celery.schedules import schedule

from celery_baton import Baton, fence
from tests.support.observer import Observer

app = Celery(
    "first_run",
    broker=os.environ["TEST_BROKER_URL"],
    backend=os.environ.get("TEST_RESULT_URL"),
)
app.conf.update(
    beat_scheduler="celery_baton.beat:Scheduler",
    broker_connection_retry_on_startup=True,
)
if os.environ.get("FIRST_RUN_LEASE_TTL"):
    app.conf.baton_lease_ttl = float(os.environ["FIRST_RUN_LEASE_TTL"])
app.conf.beat_schedule = {
    name: {
        "task": "tests.apps.first_run.tick",
        "schedule": schedule(float(spec["every"])),
        "args": (name,),
        "options": spec.get("options", {}),
    }
    for name, spec in json.loads(os.environ.get("FIRST_RUN_BEAT", "{}")).items()
}
baton = Baton(app)


@functools.cache
def observer() -> Observer:
    """This process's Observer (created after the pool forked, so never shared)."""
    return Observer(os.environ["TEST_OBSERVER_URL"])


@app.task(bind=True, exclusive="key", exclusive_conflict="wait")
def guarded(self: Task, key: str, sleep: float = 0.0) -> int:
    """One observed run of ``key``, exclusive; a duplicate waits in the consumer."""
    token = fence()
    observer().run(key, token, sleep=sleep, task_id=self.request.id)
    return token


@app.task(bind=True)
def tick(self: Task, entry: str) -> None:
    """A beat entry's run, observed as ``<entry>|<slot ms>``."""
    slot = getattr(self.request, "baton_beat_slot", None)
    observer().run(f"{entry}|{slot}", task_id=self.request.id)
