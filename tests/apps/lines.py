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

#: The gap bound: a position whose call does not come holds its key this long. Long: a
#: test looks at the key while it waits (on a loaded machine, a command line takes
#: seconds to start), then sends the missing call where a worker reads it.
GAP = 60.0
#: How long a lone call of ``index_docs`` waits for its batch (long, as GAP: a test
#: fills the batch when it has looked).
BATCH_WAIT = 60.0
#: ``index_docs``'s batch size: never reached by the calls a test looks at.
BATCH_SIZE = 50

app, baton = make_baton_app(
    "lines",
    baton_socket_timeout=1.0,
    baton_ordered_gap_timeout=GAP,
    baton_lease_ttl=4.0,
    worker_lost_wait=1.0,
    task_create_missing_queues=True,
)


@app.task(bind=True, ordered="account")
def apply_event(self: Task, account: str, n: int, sleep: float = 0.0, until: str = "") -> int:
    """Call ``n`` of ``account``'s line: one observed run of ``sleep`` seconds (with
    ``until``: until the test releases that name, ``sleep`` s at most)."""
    observer().run(f"apply:{account}", None, sleep=sleep, task_id=self.request.id, until=until)
    return n


def _report(task: str, calls: list[Call], sleep: float = 0.0, until: str = "") -> None:
    accounts = "|".join(sorted({str(c.kwargs.get("account")) for c in calls}))
    ids = ",".join(c.id for c in calls)
    observer().run(f"{task}:{accounts}", task_id=ids, sleep=sleep, until=until)


@app.task(batch="account", batch_size=BATCH_SIZE, batch_wait=BATCH_WAIT)
def index_docs(calls: list[Call]) -> list[int]:
    """Its calls wait ``BATCH_WAIT`` seconds, long enough to be seen, unless a test
    sends ``BATCH_SIZE`` of a key."""
    _report("index_docs", calls)
    return [c.kwargs["doc"] for c in calls]


@app.task(batch="account", batch_size=3, batch_wait=0.2)
def slow_index(calls: list[Call]) -> list[int]:
    """Batches of 3 that run until the test releases ``"slow_index"`` (60 s at most):
    long enough to be seen running."""
    _report("slow_index", calls, sleep=60.0, until="slow_index")
    return [c.kwargs["doc"] for c in calls]
