"""A Celery app with celery-baton installed: one task per decision that sends a task event.

Run by workers as ``celery -A tests.apps.events worker -E`` (tests/worker/test_events.py).
Reads ``TEST_BROKER_URL``, ``TEST_RESULT_URL`` and ``BATON_URL`` from the environment,
``EVENTS_HOLD_HORIZON`` (``baton_hold_horizon``, default 300 s) and ``EVENTS_QUEUE``
(the default queue, default ``celery``: a RabbitMQ test uses a queue of its own).
Every task sleeps ``sleep`` seconds and returns its arguments.
"""

from __future__ import annotations

import os
import time
from typing import Any

from tests.apps.factory import make_baton_app

app, baton = make_baton_app(
    "events",
    baton_socket_timeout=1.0,
    task_acks_late=False,
    worker_prefetch_multiplier=1,
    # A held request goes back to the broker after this long (EVENTS_HOLD_HORIZON).
    baton_hold_horizon=float(os.environ.get("EVENTS_HOLD_HORIZON", "300")),
    task_default_queue=os.environ.get("EVENTS_QUEUE", "celery"),
)


@app.task(exclusive="key", exclusive_conflict="wait")
def wait_turn(key: str, sleep: float = 0.0) -> list[Any]:
    """A duplicate is held until the key is free, then admitted."""
    time.sleep(sleep)
    return [key, sleep]


@app.task(exclusive="key")
def skip_busy(key: str, sleep: float = 0.0) -> list[Any]:
    """A duplicate is skipped."""
    time.sleep(sleep)
    return [key, sleep]


@app.task(global_rate_limit=0.5, global_rate_limit_key="host")
def fetch(host: str, sleep: float = 0.0) -> list[Any]:
    """One start per 2 s per host: the second call is held by the rate."""
    time.sleep(sleep)
    return [host, sleep]


@app.task(exclusive="key", exclusive_conflict="keep_last")
def latest(key: str, n: int, sleep: float = 0.0) -> list[Any]:
    """Of the calls waiting for the key, only the newest runs: older ones are superseded."""
    time.sleep(sleep)
    return [key, n]


@app.task(exclusive="key", exclusive_conflict="replace")
def replace_me(key: str, n: int, sleep: float = 0.0) -> list[Any]:
    """A newer call terminates the running one and runs instead."""
    time.sleep(sleep)
    return [key, n]


# 3 s: the quiet time counts from the publish, and a loaded machine's publish-to-receipt
# latency passed 0.5 s (the last call then ran at once, with nothing held).
@app.task(debounce=3.0, debounce_key="doc_id")
def save(doc_id: str, n: int) -> list[Any]:
    """A burst runs once, with the last call's arguments."""
    return [doc_id, n]


@app.task(throttle=5.0, throttle_key="user")
def notify(user: str, n: int) -> list[Any]:
    """At most one run per user in 5 s; the others are dropped."""
    return [user, n]


@app.task(exclusive="key")
def keyed(key: str) -> str:
    """Called without its key argument: refused (its key cannot be built)."""
    return key
