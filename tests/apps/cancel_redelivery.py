"""A Celery app whose broker gives an unacknowledged message back soon (a 4 s
``visibility_timeout``): a cancel kept only that long, counted from the cancel, can
expire before the copy of a message delivered just before it comes back (issue 38: the
nemesis soak, seed 721855533). Run as ``celery -A tests.apps.cancel_redelivery worker``.
"""

from __future__ import annotations

from celery import Task

from tests.apps.factory import make_baton_app, observer

VISIBILITY = 4.0

app, baton = make_baton_app(
    "cancel_redelivery",
    baton_socket_timeout=1.0,
    broker_transport_options={
        "visibility_timeout": VISIBILITY,
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
        "unacked_mutex_expire": 2,
    },
    worker_lost_wait=1.0,
)


@app.task(bind=True)
def blocker(self: Task, sleep: float) -> None:
    """Holds the one pool process, so that the next call waits in the worker."""
    observer().run("blocker", sleep=sleep, task_id=self.request.id)


@app.task(bind=True)
def plain(self: Task, n: int) -> int:
    """A plain task (nothing asked of the gate)."""
    observer().run("plain", task_id=self.request.id)
    return n
