"""A Celery app with celery-baton installed whose runs end in every way Celery knows:
returned, ``Task.replace`` (Ignore), ``Task.retry`` (issue 34.4, 35.5).

Run by workers as ``celery -A tests.apps.run_ends worker``. Reads ``TEST_BROKER_URL``,
``TEST_RESULT_URL``, ``TEST_OBSERVER_URL`` and ``BATON_URL`` from the environment.

The broker gives an unacked message back soon (``visibility_timeout`` 10 s, a restore
scan every second), so a test can kill a worker and see the copy of its message.

The ``*_main_dies`` tasks stop their worker's main process (SIGSTOP) as their body
ends, on the first run of their key only, and mark it: the test then SIGKILLs that
worker, as if it had died between the run's end and Celery's ack. The
``*_then_main_stops`` tasks stop it later, after the run's end is over in the process
that ran it (``task_postrun``: its end recorded, its result stored), on every pool:
the prefork pool processes' parent, the process that runs the body itself on threads,
gevent, eventlet and solo.

In the test process, import it inside a test that uses the ``app_environ`` fixture.
"""

from __future__ import annotations

import os
import signal
import time

from celery import Task, signals
from celery.exceptions import Reject

from tests.apps.factory import make_baton_app, marks, observer

app, baton = make_baton_app(
    "run_ends",
    broker_transport_options={
        "visibility_timeout": 10,
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
        # A worker killed while it held kombu's restore lock keeps every message from
        # coming back until the lock expires (300 s by default).
        "unacked_mutex_expire": 5,
    },
    # Where uq_routed waits: a queue a process knows only once it routed a call there.
    task_routes={"tests.apps.run_ends.uq_routed": {"queue": "uq-routed"}},
)

#: The queue a retry or a replacement is sent to: no worker consumes it until the test
#: starts one (a worker whose main process is stopped still takes the next message of
#: a queue it consumes: kombu's BRPOP was sent before the stop, and the message is lost
#: with the worker).
PARKED = "parked"


def main_stopped_mark(key: str) -> str:
    """Set by the first run of a ``*_main_dies`` task with ``key`` that stopped its main
    process (only the first: a later run of the key must end normally)."""
    return f"run_ends:main-stopped:{key}"


def _first_run_stops(key: str, main: int) -> None:
    """The first run of ``key`` stops process ``main`` (SIGSTOP) and marks it."""
    if marks().set(main_stopped_mark(key), str(main), nx=True):
        os.kill(main, signal.SIGSTOP)


def _first_run_stops_its_main_process(key: str) -> None:
    _first_run_stops(key, os.getppid())


@app.task(bind=True, redelivery_guard=True, acks_late=True)
def replace_main_dies(self: Task, key: str, step: int) -> str:
    """Guarded: replaces itself with ``step - 1`` down to 0 (each step recorded as
    ``key:step``), sent to the ``parked`` queue; the first step's first run stops its
    main process as it replaces."""
    observer().run(f"{key}:{step}", task_id=self.request.id)
    if step == 0:
        return "done"
    _first_run_stops_its_main_process(key)
    raise self.replace(replace_main_dies.si(key, step - 1).set(queue=PARKED))


@app.task(bind=True, redelivery_guard=True, acks_late=True)
def retry_main_dies(self: Task, key: str) -> str:
    """Guarded: its first attempt (recorded as ``key:0``) stops its main process and
    retries to the ``parked`` queue; the retry (``key:1``) returns."""
    attempt = self.request.retries
    observer().run(f"{key}:{attempt}", task_id=self.request.id)
    if attempt > 0:
        return "done"
    _first_run_stops_its_main_process(key)
    raise self.retry(countdown=0, queue=PARKED, max_retries=3)


@app.task(bind=True, redelivery_guard=True, acks_late=True)
def reject_main_dies(self: Task, key: str) -> str:
    """Guarded: its first run stops its main process and rejects its message for good
    (``Reject(requeue=False)``: Celery rejects it, and stores FAILURE)."""
    observer().run(key, task_id=self.request.id)
    _first_run_stops_its_main_process(key)
    raise Reject("not wanted", requeue=False)


@app.task(bind=True, unique="key")
def uq_quick(self: Task, key: str) -> str:
    """Unique (Celery's defaults otherwise): returns at once."""
    return self.request.id


@app.task(bind=True, unique="key", queue="uq-own-queue")
def uq_own_queue(self: Task, key: str) -> str:
    """``uq_quick`` sent to a queue of its own (the task's ``queue=``)."""
    return self.request.id


@app.task(bind=True, unique="key")
def uq_routed(self: Task, key: str) -> str:
    """``uq_quick`` sent to a queue of its own (``task_routes``)."""
    return self.request.id


@app.task(bind=True, unique="key")
def uq_sleeping(self: Task, key: str, seconds: float) -> str:
    """Unique: runs ``seconds``."""
    time.sleep(seconds)
    return self.request.id


@app.task(bind=True, unique="key", redelivery_guard=True)
def uq_quick_guarded(self: Task, key: str) -> str:
    """Unique and guarded: returns at once."""
    return self.request.id


@app.task(bind=True, unique="key", time_limit=0.5)
def uq_past_its_time_limit(self: Task, key: str) -> str:
    """Unique, a hard time limit of 0.5 s: runs past it (its process killed, its greenlet
    unwound), Celery's main process stores its FAILURE."""
    time.sleep(10)
    return self.request.id


@app.task(bind=True, unique="key")
def uq_process_killed(self: Task, key: str) -> str:
    """Unique: kills its own pool process (as the OOM killer would); Celery's main
    process stores its FAILURE (``WorkerLostError``). Prefork only."""
    os.kill(os.getpid(), signal.SIGKILL)
    return self.request.id


@app.task(bind=True, exclusive="key")
def ex_process_killed(self: Task, key: str, kill: bool) -> str:
    """Exclusive (a duplicate is skipped): kills its own pool process when told to
    (``WorkerLostError``, stored by Celery's main process), else returns. Prefork only."""
    if kill:
        os.kill(os.getpid(), signal.SIGKILL)
    return "ran"


@app.task(bind=True, exclusive="key", time_limit=0.5)
def ex_past_its_time_limit(self: Task, key: str) -> str:
    """Exclusive, a hard time limit of 0.5 s: runs past it (its process killed, its
    greenlet unwound), Celery's main process stores its FAILURE."""
    time.sleep(10)
    return "ran"


@app.task
def sleeper(seconds: float) -> None:
    """Keeps a pool process busy for ``seconds`` (a message behind it expires meanwhile)."""
    time.sleep(seconds)


@app.task(bind=True, unique="key", acks_late=True)
def uq_quick_late(self: Task, key: str) -> str:
    """Unique, acks_late: returns at once."""
    return self.request.id


#: The worker's main process, remembered there before its pool starts (``worker_init``);
#: a prefork pool process, forked from it, inherits it. (Not ``os.getppid()`` in a pool
#: process: the solo pool sends ``worker_process_init`` in the main process too.)
_main_process = 0


@signals.worker_init.connect
def _remember_the_main_process(**_: object) -> None:
    global _main_process
    _main_process = os.getpid()


@signals.task_postrun.connect
def _stop_the_main_process_after_the_end(
    task: Task | None = None, args: tuple[object, ...] = (), **_: object
) -> None:
    """After celery-baton's own ``task_postrun`` receiver (connected when the worker
    starts, before this module's tasks run) and after the result was stored: the first
    run of a ``*_then_main_stops`` key stops its worker's main process before the ack."""
    if task is None or not task.name.endswith("_then_main_stops") or not args:
        return
    if _main_process:  # in a worker only: never stop anything else
        _first_run_stops(str(args[0]), _main_process)


@app.task(bind=True, redelivery_guard=True, acks_late=True)
def returns_then_main_stops(self: Task, key: str) -> str:
    """Guarded, acks_late: returns; its first run's worker stops after the end."""
    observer().run(key, task_id=self.request.id)
    return "done"


@app.task(bind=True, redelivery_guard=True, acks_late=True)
def retries_then_main_stops(self: Task, key: str) -> str:
    """Guarded, acks_late: its first attempt (``key:0``) retries to the ``parked``
    queue and its worker stops after the end; the retry (``key:1``) returns."""
    attempt = self.request.retries
    observer().run(f"{key}:{attempt}", task_id=self.request.id)
    if attempt > 0:
        return "done"
    raise self.retry(countdown=0, queue=PARKED, max_retries=3)


@signals.task_failure.connect
def _stop_the_main_process_after_the_failure(
    sender: Task | None = None, args: tuple[object, ...] = (), **_: object
) -> None:
    """Celery's main process, right after it stored the FAILURE of a run past its hard
    time limit (``on_timeout``) and before it acks it (``acks_late``): the first run of
    a ``*_past_its_limit_stops_at_failure`` key stops the main process there."""
    if sender is None or not sender.name.endswith("_past_its_limit_stops_at_failure"):
        return
    if _main_process and os.getpid() == _main_process and args:
        _first_run_stops(str(args[0]), _main_process)


@app.task(bind=True, redelivery_guard=True, acks_late=True, time_limit=0.5)
def guarded_past_its_limit_stops_at_failure(self: Task, key: str) -> str:
    """Guarded, acks_late, a hard time limit of 0.5 s: runs past it."""
    observer().run(key, task_id=self.request.id)
    time.sleep(10)
    return "done"
