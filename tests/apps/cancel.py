"""A Celery app with celery-baton installed: sticky cancels under test (issue 38 §2).

Run by workers as ``celery -A tests.apps.cancel worker``. Every task reports its run to
the :class:`~tests.support.observer.Observer` under its task id: the observer, not the
library, says which calls ran. Results are kept (a cancelled call's state is REVOKED).
"""

from __future__ import annotations

import os

from celery import Task

from tests.apps.factory import make_baton_app, observer

app, baton = make_baton_app(
    "cancel",
    baton_socket_timeout=1.0,
    broker_transport_options={
        "visibility_timeout": 3600,
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    },
    worker_lost_wait=1.0,
    # TEST_ACKS_LATE=1 in a worker's environment: its messages are acked after the run.
    task_acks_late=os.environ.get("TEST_ACKS_LATE") == "1",
    # CANCEL_REMOTE_CONTROL=0: workers that take no remote control (no mailbox).
    worker_enable_remote_control=os.environ.get("CANCEL_REMOTE_CONTROL", "1") == "1",
)


@app.task(bind=True, global_rate_limit="5/s")
def limited(self: Task, n: int) -> int:
    """5 starts per second across all workers: a backlog is held in the workers."""
    observer().run("limited", task_id=self.request.id)
    return n


@app.task(bind=True, exclusive="n")
def exclusive(self: Task, n: int) -> int:
    """A guarded task without a rate: its grant is a lease."""
    observer().run("exclusive", task_id=self.request.id)
    return n


@app.task(bind=True)
def keyed(self: Task, account_id: int, n: int) -> int:
    """A plain task (nothing asked of the gate), cancelled by key."""
    observer().run(f"keyed:{account_id}", sleep=0.05, task_id=self.request.id)
    return n


@app.task(bind=True, debounce=0.5, debounce_key="doc_id")
def debounced(self: Task, doc_id: str) -> str:
    """Debounced and nothing else: no gate call a cancel could be checked in."""
    observer().run(f"debounced:{doc_id}", task_id=self.request.id)
    return doc_id


@app.task(bind=True)
def slow(self: Task, seconds: float) -> float:
    """A body that runs for a while: stopped by ``terminate=True``."""
    observer().run("slow", sleep=seconds, task_id=self.request.id)
    return seconds


@app.task(bind=True)
def slow_keyed(self: Task, account_id: int, seconds: float) -> float:
    """A plain body that runs for a while, cancelled by key (``account_id``)."""
    observer().run(f"slow:{account_id}", sleep=seconds, task_id=self.request.id)
    return seconds
