"""A Celery app with celery-baton installed: how a delivery ends, as Celery decides it.

Run by workers as ``celery -A tests.apps.finality worker``. Reads ``TEST_BROKER_URL``,
``TEST_RESULT_URL``, ``TEST_OBSERVER_URL`` and ``BATON_URL`` (the store under test) from
the environment.

Each task here ends in a way where Celery's own decision about the message (acked,
rejected with requeue, retried) is not what the exception alone suggests: a pool child
that dies on every run with ``retry_on_worker_lost``, a task that calls ``sys.exit()``
once under ``reject_on_worker_lost``, a child that dies after its SUCCESS was stored.
Every run reports its start (and, when it lives, its end) to the
:class:`~tests.support.observer.Observer` under its key.

In the test process, import it inside a test that uses the ``app_environ`` fixture.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from celery import Task, signals, states

from tests.apps.factory import make_baton_app, marks, observer

app, baton = make_baton_app(
    "finality",
    baton_socket_timeout=1.0,
    task_acks_late=False,
    # Prefetch 1: with Celery's default (4) test_retries_used_up_after_lost_workers_free_
    # the_unique_key timed out once in a loaded CI rehearsal (2026-11-29): not understood
    # yet, to look at with the default again.
    worker_prefetch_multiplier=1,
    # A test of a killed worker's messages sets a short one (the broker gives them back
    # after it): FINALITY_VISIBILITY seconds, restored every second.
    broker_transport_options={
        "visibility_timeout": float(os.environ.get("FINALITY_VISIBILITY", "3600")),
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    },
    # Celery waits this long after a pool child died before it fails the job with
    # WorkerLostError (default 10 s).
    worker_lost_wait=1.0,
)


@app.task(bind=True, unique="key", retry_on_worker_lost=True, max_retries=1, default_retry_delay=0)
def lost_every_run(self: Task, key: str, die: bool = True) -> str:
    """Unique; its pool child dies on every run when ``die`` (not part of the key).

    Celery retries it once under the same id (``retry_on_worker_lost``), then fails it
    for good: its unique key must be free then."""
    with observer().track(key, task_id=self.request.id):
        if die:
            os._exit(1)
    return "ran"


@app.task(bind=True, acks_late=True, reject_on_worker_lost=True, redelivery_guard=True)
def exits_once(self: Task, key: str) -> str:
    """Guarded; calls ``sys.exit()`` on its first delivery only. Celery requeues the
    message (a lost worker under ``reject_on_worker_lost``): the copy must run."""
    if marks().set(exited_mark(self.request.id), "1", nx=True):
        sys.exit(1)  # (before the observer hears of it: only the copy's run is recorded)
    observer().run(key, task_id=self.request.id)
    return "ran"


def exited_mark(task_id: str) -> str:
    """The observer-db key :func:`exits_once` sets before it exits."""
    return f"finality:exited:{task_id}"


@app.task(bind=True, unique="key", acks_late=True, reject_on_worker_lost=True)
def dies_after_success(self: Task, key: str) -> str:
    """Unique; its pool child dies after the SUCCESS was stored (see the handler below).
    Celery acks the message and keeps the SUCCESS: its unique key must be free then."""
    observer().run(key, task_id=self.request.id)
    return "ran"


@signals.task_postrun.connect
def _die_after_success(sender: Any = None, state: str | None = None, **_: Any) -> None:
    # task_postrun comes after the result backend stored SUCCESS, in the pool child.
    # (``dies_after_success`` is Celery's lazy proxy of the task: compare names.)
    if getattr(sender, "name", None) == dies_after_success.name and state == states.SUCCESS:
        os._exit(1)


@app.task(bind=True, unique="key")
def uq_long(self: Task, key: str, sleep: float) -> str:
    """Unique (no other option: the worker has no gate call for it without ``expires``)."""
    observer().run(key, sleep=sleep, task_id=self.request.id)
    return str(self.request.id)


@app.task(bind=True, unique="key", global_concurrency=10)
def uq_long_gated(self: Task, key: str, sleep: float) -> str:
    """Unique and limited: every delivery goes through the gate anyway."""
    observer().run(key, sleep=sleep, task_id=self.request.id)
    return str(self.request.id)


@app.task(bind=True, unique="key", acks_late=True, reject_on_worker_lost=True)
def uq_late(self: Task, key: str, sleep: float) -> str:
    """Unique and ``acks_late``: a killed worker's run comes back from the broker."""
    observer().run(key, sleep=sleep, task_id=self.request.id)
    return str(self.request.id)


@app.task(bind=True, unique="key", acks_late=True, reject_on_worker_lost=True, lease_ttl=2.0)
def uq_late_short(self: Task, key: str, sleep: float) -> str:
    """:func:`uq_late` whose run's hold on its key lapses 2 s after its worker died."""
    observer().run(key, sleep=sleep, task_id=self.request.id)
    return str(self.request.id)


def unique_key(task: Task, *args: Any, **kwargs: Any) -> str:
    """The store key that a publish of ``task(*args, **kwargs)`` claims."""
    policy = baton.policy_for(task)
    assert policy is not None and policy.unique is not None
    return policy.unique_key(baton.names, args, kwargs)
