"""A Celery app with celery-baton installed: a backlog held store-wide, then run by
the workers together (tests/worker/test_hold_spread.py).

Celery's defaults (prefetch multiplier 4, early acks), with these knobs:

* ``SPREAD_LEASE_TTL`` -- ``baton_lease_ttl`` (a fresh store's grace lasts until its
  start + this);
* ``SPREAD_QUEUE`` -- the default queue's name (a RabbitMQ test's own queue);
* ``SPREAD_QUEUE_TYPE`` -- ``quorum``: a RabbitMQ quorum queue (its prefetch is per
  consumer: worker/transport/consumer_window.py opens the consumer again).

Each run reports to the observer under its worker's hostname: the test counts the runs
of each worker from outside. ``capped`` is the held-for-a-limit form: at most
:data:`CAP` running anywhere, a cap wider than one worker's pool.
"""

from __future__ import annotations

import os

from celery import Task
from kombu import Queue

from tests.apps.factory import make_baton_app, observer

QUEUE = os.environ.get("SPREAD_QUEUE", "celery")
QUEUE_TYPE = os.environ.get("SPREAD_QUEUE_TYPE", "")
CAP = 4


def queues(name: str, queue_type: str) -> list[Queue]:
    """The default queue, declared as the test's publisher declares it."""
    arguments = {"x-queue-type": queue_type} if queue_type else None
    return [Queue(name, queue_arguments=arguments)]


app, baton = make_baton_app(
    "spread",
    baton_socket_timeout=1.0,
    baton_lease_ttl=float(os.environ.get("SPREAD_LEASE_TTL", "8")),
    task_ignore_result=True,
    task_default_queue=QUEUE,
    task_queues=queues(QUEUE, QUEUE_TYPE),
)


@app.task(bind=True, exclusive="n")
def work(self: Task, n: int, sleep: float = 0.1) -> None:
    """One call of the backlog: exclusive per ``n``, so every call asks the gate (and
    never waits for another)."""
    observer().run(str(self.request.hostname), sleep=sleep, task_id=self.request.id)


@app.task(bind=True, global_concurrency=CAP)
def capped(self: Task, n: int, sleep: float = 0.1) -> None:
    """One call of a backlog held for its cap (not store-wide): at most 4 run anywhere."""
    observer().run(str(self.request.hostname), sleep=sleep, task_id=self.request.id)
