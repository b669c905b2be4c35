"""``exclusive_conflict="replace"`` on an app with no result backend (issue 39 §4): there
is nothing to record a replaced run in, and nothing to log about it."""

from __future__ import annotations

import time

from tests.apps.factory import make_baton_app, observer

app, baton = make_baton_app(
    "supersede_no_results", results=False, task_acks_late=False, worker_prefetch_multiplier=1
)


@app.task(exclusive="key", exclusive_conflict="replace", lease_ttl=3)
def replaced(key: str, n: int, sleep: float) -> None:
    with observer().track(key, n):
        time.sleep(sleep)
