"""A Celery app with celery-baton installed: debounced and throttled tasks under test.

Run by workers as ``celery -A tests.apps.debounce worker``. Reads ``TEST_BROKER_URL``,
``TEST_RESULT_URL``, ``TEST_OBSERVER_URL`` and ``BATON_URL`` from the environment, and
``DEBOUNCE_VISIBILITY``: the Redis broker's ``visibility_timeout`` (default 3600 s; a
test that kills a worker sets a few seconds, so its held messages come back soon), and
``DEBOUNCE_BEAT``: set, the beat schedule publishes ``save`` every 0.3 s;
``DEBOUNCE_GLOBAL_RATES``: set, ``baton_global_rate_limits`` is on.

Every task reports its run to the observer under ``"<task>:<key>"`` with the argument it
ran with in the run's task id field, and returns that argument.
"""

from __future__ import annotations

import os

from celery import Task

from tests.apps.factory import make_baton_app, observer

VISIBILITY = float(os.environ.get("DEBOUNCE_VISIBILITY", "3600"))

# Settings that depend on the test.
_OPTIONAL: dict[str, object] = {}
if os.environ.get("DEBOUNCE_BEAT"):
    # Celery's own beat, publishing save("beat", 7) every 0.3 s: a steady stream.
    _OPTIONAL["beat_schedule"] = {
        "save-often": {"task": "tests.apps.debounce.save", "schedule": 0.3, "args": ("beat", 7)}
    }
if os.environ.get("DEBOUNCE_GLOBAL_RATES"):
    _OPTIONAL["baton_global_rate_limits"] = True  # Celery's rate_limit, across all workers
app, baton = make_baton_app(
    "debounce",
    baton_socket_timeout=1.0,
    task_acks_late=False,
    broker_transport_options={
        "visibility_timeout": VISIBILITY,
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    },
    # Celery waits this long after a pool child died before it fails the job with
    # WorkerLostError (default 10 s).
    worker_lost_wait=1.0,
    **_OPTIONAL,
)


def _run(task: Task, key: str, version: int) -> int:
    observer().run(f"{task.name.rsplit('.', 1)[-1]}:{key}", task_id=f"{task.request.id}|{version}")
    return version


@app.task(bind=True, debounce=1.0, debounce_key="doc_id")
def save(self: Task, doc_id: str, version: int) -> int:
    """Debounced per doc_id: runs 1 s after the last publish, with its version."""
    return _run(self, doc_id, version)


@app.task(bind=True, debounce=1.0, debounce_key="doc_id", debounce_max_wait=2.5)
def capped(self: Task, doc_id: str, version: int) -> int:
    """Debounced with a 2.5 s max wait: a steady stream still runs every ~2.5 s."""
    return _run(self, doc_id, version)


@app.task(bind=True, throttle=1.0, throttle_key="user")
def ping(self: Task, user: str, version: int) -> int:
    """Throttled per user, drop mode: the first in each 1 s window runs."""
    return _run(self, user, version)


@app.task(bind=True, throttle=1.0, throttle_key="user", throttle_mode="trailing")
def sync(self: Task, user: str, version: int) -> int:
    """Throttled per user, trailing mode: the first runs, the newest of the rest at the
    window's end."""
    return _run(self, user, version)


@app.task(bind=True, debounce=1.0, debounce_key="doc_id")
def slow(self: Task, doc_id: str, version: int) -> int:
    """Debounced, and runs 30 s: long enough to kill its pool child mid-run."""
    observer().run(f"slow:{doc_id}", sleep=30, task_id=f"{self.request.id}|{version}")
    return version


@app.task(bind=True, debounce=1.0, debounce_key="doc_id", time_limit=1.5)
def overrun(self: Task, doc_id: str, version: int) -> int:
    """Debounced, and runs 6 s against a hard time limit of 1.5 s: killed mid-run."""
    observer().run(f"overrun:{doc_id}", sleep=6, task_id=f"{self.request.id}|{version}")
    return version


@app.task(bind=True, debounce=1.0, debounce_key="doc_id", max_retries=3)
def flaky(self: Task, doc_id: str, version: int) -> int:
    """Debounced; its first attempt retries (a new delivery of the same task id)."""
    if self.request.retries == 0:
        raise self.retry(countdown=0.2)
    return _run(self, doc_id, version)


@app.task(bind=True, debounce=1.0, debounce_key="doc_id", rate_limit="100/s")
def rated(self: Task, doc_id: str, version: int) -> int:
    """Debounced, with Celery's own rate_limit (global with DEBOUNCE_GLOBAL_RATES)."""
    return _run(self, doc_id, version)
