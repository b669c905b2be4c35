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

import json
import os

from celery import Task
from celery.schedules import schedule

from celery_baton import fence
from tests.apps.factory import make_baton_app, observer

# The app-wide lease_ttl when the test sets one (else the default).
_LEASE_TTL = (
    {"baton_lease_ttl": float(os.environ["FIRST_RUN_LEASE_TTL"])}
    if os.environ.get("FIRST_RUN_LEASE_TTL")
    else {}
)
app, baton = make_baton_app(
    "first_run",
    store_from_env=False,  # found by Baton from $BATON_URL, as a user's would be
    beat_scheduler="celery_baton.beat:Scheduler",
    **_LEASE_TTL,
    beat_schedule={
        name: {
            "task": "tests.apps.first_run.tick",
            "schedule": schedule(float(spec["every"])),
            "args": (name,),
            "options": spec.get("options", {}),
        }
        for name, spec in json.loads(os.environ.get("FIRST_RUN_BEAT", "{}")).items()
    },
)


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
