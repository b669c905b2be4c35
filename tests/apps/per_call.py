"""Per-call options (issue 16): one task called under different policies.

* :func:`feed` declares ``exclusive="tenant"`` (skip); calls may override its key and
  policy with ``baton={...}``;
* :func:`job` declares nothing: per-call options are all it has;
* :func:`report` is ``unique`` on ``report_id``; ``baton={"unique_conflict": "raise"}``
  makes a duplicate publish raise ``AlreadyQueued``;
* every run records its observer key as ``<run label>`` and the kwargs it received.
"""

from __future__ import annotations

import json
from typing import Any

from celery import Task

from celery_baton import fence
from tests.apps.factory import make_baton_app, observer

app, baton = make_baton_app("per_call", baton_socket_timeout=1.0)


def _run(task: Task, label: str, sleep: float, kwargs: dict[str, Any]) -> str:
    token = fence() if task.request.get("baton_fence") else None
    observer().run(label, token, sleep=sleep, task_id=task.request.id)
    return json.dumps(sorted(kwargs))  # the kwargs it received, for the test to check


@app.task(bind=True, exclusive="tenant")
def feed(self: Task, tenant: str, label: str, sleep: float = 0.0, **extra: Any) -> str:
    return _run(self, label, sleep, {"tenant": tenant, "label": label, **extra})


@app.task(bind=True)
def job(self: Task, label: str, sleep: float = 0.0, **extra: Any) -> str:
    return _run(self, label, sleep, {"label": label, **extra})


@app.task(bind=True, unique="report_id")
def report(self: Task, report_id: int, sleep: float = 0.0) -> str:
    return _run(self, f"report-{report_id}", sleep, {})
