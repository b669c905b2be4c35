"""A Celery app with celery-baton installed and one batched task whose ``batch_wait``
(1 s) sets the batching tick to its longest, 50 ms (tests/batching/test_batch_claims.py:
how many batches of a key start per tick). Celery's defaults otherwise."""

from __future__ import annotations

from celery_baton import Call
from tests.apps.factory import make_baton_app, observer

app, baton = make_baton_app("batch_claims")


@app.task(batch="account", batch_size=5, batch_wait=1.0)
def side_by_side(calls: list[Call]) -> list[int]:
    """Batches of 5 whose body runs 1.5 s: a backlog of many full batches that a worker
    with as many free processes starts side by side."""
    keys = "|".join(sorted({str(c.kwargs.get("account")) for c in calls}))
    observer().run(f"side_by_side:{keys}", task_id=",".join(c.id for c in calls), sleep=1.5)
    return [c.kwargs["doc"] for c in calls]
