"""A Celery app with celery-baton installed: an ordered task and batched tasks, for the
operator's views of their keys (tests/ops/test_lines.py).

Run by workers as ``celery -A tests.apps.lines worker``; reads its servers from the
environment (tests/apps/factory.py). Every run reports to the observer: an ordered call
under ``"apply:<account>"``, a batch under ``"<task>:<account>"`` with its call ids.
"""

from __future__ import annotations

from celery import Task

from celery_baton import Call
from tests.apps.factory import make_baton_app, observer

#: The gap bound: a position whose call does not come holds its key this long.
GAP = 20.0
#: How long a lone call of ``index_docs`` waits for its batch.
BATCH_WAIT = 12.0

app, baton = make_baton_app(
    "lines",
    baton_socket_timeout=1.0,
    baton_ordered_gap_timeout=GAP,
    baton_lease_ttl=4.0,
    worker_lost_wait=1.0,
    task_create_missing_queues=True,
)


@app.task(bind=True, ordered="account")
def apply_event(self: Task, account: str, n: int, sleep: float = 0.0) -> int:
    """Call ``n`` of ``account``'s line: one observed run of ``sleep`` seconds."""
    observer().run(f"apply:{account}", None, sleep=sleep, task_id=self.request.id)
    return n


def _report(task: str, calls: list[Call], sleep: float = 0.0) -> None:
    accounts = "|".join(sorted({str(c.kwargs.get("account")) for c in calls}))
    observer().run(f"{task}:{accounts}", task_id=",".join(c.id for c in calls), sleep=sleep)


@app.task(batch="account", batch_size=1000, batch_wait=BATCH_WAIT)
def index_docs(calls: list[Call]) -> list[int]:
    """Never full: its calls wait ``BATCH_WAIT`` seconds, long enough to be seen."""
    _report("index_docs", calls)
    return [c.kwargs["doc"] for c in calls]


@app.task(batch="account", batch_size=3, batch_wait=0.2)
def slow_index(calls: list[Call]) -> list[int]:
    """Batches of 3 that run 12 s: long enough to be seen running."""
    _report("slow_index", calls, sleep=12.0)
    return [c.kwargs["doc"] for c in calls]
