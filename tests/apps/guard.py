"""A Celery app with celery-baton installed: the redelivery guard under test (issue 5).

Run by workers as ``celery -A tests.apps.guard worker``. Reads ``TEST_BROKER_URL``,
``TEST_RESULT_URL``, ``TEST_OBSERVER_URL`` and ``BATON_URL`` (the store under test) from
the environment, and these knobs:

* ``GUARD_ON`` -- ``app.conf.baton_redelivery_guard`` (default ``"1"``). With ``"0"``
  only :func:`slow_guarded` (``redelivery_guard=True``) is guarded.
* ``GUARD_VISIBILITY`` -- the Redis broker's ``visibility_timeout`` in seconds (default
  3600); the broker sweeps for overdue messages every second.
* ``GUARD_QUEUE`` -- the default queue (default ``celery``): a RabbitMQ test uses a
  queue of its own on the shared server.
* ``GUARD_HEARTBEAT`` -- ``broker_heartbeat`` in seconds (AMQP only; default Celery's).

Every task is ``acks_late`` with ``reject_on_worker_lost``, and reports its run to the
:class:`~tests.support.observer.Observer` under the key of its own task id, so
``observer.max_running(task_id)`` is how many copies of one task id ever ran at once.

In the test process, import it inside a test that uses the ``app_environ`` fixture.
"""

from __future__ import annotations

import os

from celery import Task

from tests.apps.factory import make_baton_app, observer

VISIBILITY = float(os.environ.get("GUARD_VISIBILITY", "3600"))

# Settings that depend on the test: a Redis broker gives back an unacknowledged message
# after VISIBILITY seconds (restored every second); GUARD_HEARTBEAT sets an AMQP heartbeat.
_BROKER: dict[str, object] = {}
if not os.environ["TEST_BROKER_URL"].startswith("amqp"):
    _BROKER["broker_transport_options"] = {
        "visibility_timeout": VISIBILITY,
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    }
if "GUARD_HEARTBEAT" in os.environ:
    _BROKER["broker_heartbeat"] = float(os.environ["GUARD_HEARTBEAT"])

app, baton = make_baton_app(
    "guard",
    baton_socket_timeout=1.0,
    baton_redelivery_guard=os.environ.get("GUARD_ON", "1") == "1",
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    task_default_queue=os.environ.get("GUARD_QUEUE", "celery"),
    # Celery's default prefetch (4): a deployment profile, not a lab.
    # Celery waits this long after a pool child died before it fails the job with
    # WorkerLostError (default 10 s).
    worker_lost_wait=1.0,
    **_BROKER,
)


@app.task(bind=True)
def slow(self: Task, sleep: float) -> None:
    """Guarded when ``GUARD_ON`` is on (the app-wide setting)."""
    observer().run(self.request.id, sleep=sleep, task_id=self.request.id)


@app.task(bind=True, redelivery_guard=True)
def slow_guarded(self: Task, sleep: float) -> None:
    """Always guarded: the per-task option."""
    observer().run(self.request.id, sleep=sleep, task_id=self.request.id)


@app.task(bind=True)
def fails(self: Task) -> None:
    """A run that ends in an exception (a final end: its id is done too)."""
    observer().run(self.request.id, task_id=self.request.id)
    raise ValueError("fails on purpose")


@app.task(time_limit=30)
def bounded() -> None:
    """May run 30 s: longer than a 2 s visibility timeout, so the worker warns."""


@app.task(time_limit=1)
def quick() -> None:
    """May run 1 s: shorter than any visibility timeout used here, no warning."""


@app.task(bind=True, redelivery_guard=True, max_retries=2, default_retry_delay=0)
def retries_twice(self: Task) -> int:
    """Guarded; retries itself twice under its own id (``self.retry()``), then returns:
    a retry is not an end, so each new delivery of the id runs."""
    observer().run(self.request.id, task_id=self.request.id)
    if self.request.retries < 2:
        raise self.retry()
    return self.request.retries


@app.task(
    bind=True,
    redelivery_guard=True,
    autoretry_for=(KeyError,),
    max_retries=1,
    default_retry_delay=0,
)
def autoretries_once(self: Task) -> int:
    """Guarded; fails once with an exception in ``autoretry_for``, then returns."""
    observer().run(self.request.id, task_id=self.request.id)
    if self.request.retries < 1:
        raise KeyError("once")
    return self.request.retries
