"""A Celery app with celery-baton installed: ordered keys under test (issue 38 §1).

Run by workers as ``celery -A tests.apps.ordered worker``. Reads ``TEST_BROKER_URL``,
``TEST_RESULT_URL``, ``TEST_OBSERVER_URL`` and ``BATON_URL`` from the environment, and:

* ``ORDERED_GAP`` -- ``baton_ordered_gap_timeout`` in seconds (default 20);
* ``ORDERED_VISIBILITY`` -- the Redis broker's ``visibility_timeout`` (default 4 s,
  swept every second): a killed worker's unacked messages come back that soon.

Every task is ``acks_late`` and reports its run to the
:class:`~tests.support.observer.Observer` under its key, with its task id: the test
knows each call's publish order, the observer the order the runs started in.

In the test process, import it inside a test that uses the ``app_environ`` fixture.
"""

from __future__ import annotations

import os

from celery import Task

from tests.apps.factory import make_baton_app, observer

GAP = float(os.environ.get("ORDERED_GAP", "20"))
VISIBILITY = float(os.environ.get("ORDERED_VISIBILITY", "4"))
LEASE_TTL = 2.0

app, baton = make_baton_app(
    "ordered",
    baton_socket_timeout=1.0,
    baton_ordered_gap_timeout=GAP,
    baton_lease_ttl=LEASE_TTL,
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=4,
    worker_lost_wait=1.0,
    broker_transport_options={
        "visibility_timeout": VISIBILITY,
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
        # A worker killed while it held kombu's restore lock keeps every message from
        # coming back until the lock expires (300 s by default): its calls would come
        # after the gap bound skipped them (the worker warns of that at start).
        "unacked_mutex_expire": 5,
    },
    task_create_missing_queues=True,
)


@app.task(bind=True, ordered="key")
def ordered_apply(self: Task, key: str, n: int, sleep: float = 0.0) -> int:
    """Call ``n`` of ``key``: one observed run."""
    observer().run(key, None, sleep=sleep, task_id=self.request.id)
    return n


@app.task(bind=True, exclusive="key", exclusive_conflict="wait")
def waiting_apply(self: Task, key: str, n: int, sleep: float = 0.0) -> int:
    """The same with ``exclusive_conflict="wait"``: one at a time, in no given order."""
    observer().run(key, None, sleep=sleep, task_id=self.request.id)
    return n


@app.task(bind=True, ordered="key", max_retries=3)
def ord_retry(self: Task, key: str, n: int, countdown: float = 1.0) -> int:
    """Call ``n`` of ``key``; call 0 retries once, ``countdown`` s later."""
    observer().run(key, None, task_id=self.request.id)
    if n == 0 and self.request.retries == 0:
        raise self.retry(countdown=countdown)
    return n


@app.task(bind=True, ordered="key")
def ord_replaced(self: Task, key: str, n: int) -> int:
    """Call ``n`` of ``key``; below 100 it replaces itself by call ``n + 100`` of the
    same key (``Task.replace``: the same task id, a new publish)."""
    observer().run(key, None, task_id=self.request.id)
    if n < 100:
        raise self.replace(ord_replaced.si(key, n + 100))
    return n
