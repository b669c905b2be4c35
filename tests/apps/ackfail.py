"""A Celery app with celery-baton installed whose broker ack can fail, or whose main
process dies after a run ended (issue 11).

Run by workers as ``celery -A tests.apps.ackfail worker``. Reads ``TEST_BROKER_URL``,
``TEST_OBSERVER_URL`` and ``BATON_URL`` (the store under test) from the environment.

The broker (a redis-server whose writes the test may pause) has a short
``socket_timeout``, so an ack sent while it is paused fails within seconds ("Couldn't
ack", logged by kombu, while Celery still calls the request acknowledged), and a short
``visibility_timeout``
with a restore scan every second, so the unacked message comes back within seconds.

The tasks record their run with the observer, then (on their first delivery only) tell
the test, through a mark in the observer's database, that they are about to return: the
test pauses the broker, and the ack that follows the run (``acks_late``) fails.

The ``*_main_dies`` tasks stop their worker's main process (SIGSTOP) as their body
returns, on their first delivery only, and mark it: the test then SIGKILLs that worker,
as if its consumer had died right after the run (a crash between the pool process
reporting back and the main process recording it).

In the test process, import it inside a test that uses the ``app_environ`` fixture.
"""

from __future__ import annotations

import os
import signal
import time

from celery import Task

from tests.apps.factory import PAUSABLE_BROKER, make_baton_app, marks, observer

#: Seconds a first run waits, after it asked for the broker to be paused, before it
#: returns (so that the ack is sent to a paused broker).
WAIT_FOR_STOP = 1.5

app, baton = make_baton_app(
    "ackfail",
    results=False,
    baton_socket_timeout=1.0,
    task_acks_late=True,
    task_ignore_result=True,  # (the result backend would live on the stopped server)
    worker_prefetch_multiplier=1,
    broker_transport_options=PAUSABLE_BROKER,
)


def stop_mark(task_id: str) -> str:
    """Set by a task's first run when the test should pause the broker."""
    return f"ackfail:stop:{task_id}"


def _first_run_asks_for_a_stop(task_id: str) -> None:
    if marks().set(stop_mark(task_id), "1", nx=True):
        time.sleep(WAIT_FOR_STOP)


@app.task(bind=True, unique="key")
def uq_ack(self: Task, key: str) -> str:
    """Unique, acks_late: its first run's ack is sent to a paused broker."""
    observer().run(key, task_id=self.request.id)
    _first_run_asks_for_a_stop(self.request.id)
    return "ran"


@app.task(bind=True, unique="key", redelivery_guard=True)
def uq_ack_guarded(self: Task, key: str) -> str:
    """The same under the redelivery guard: the copy of a run that ended is not run."""
    observer().run(key, task_id=self.request.id)
    _first_run_asks_for_a_stop(self.request.id)
    return "ran"


def broker_pid_mark() -> str:
    """The broker server's pid, set by a test whose task stops the broker itself."""
    return "ackfail:broker-pid"


@app.task(bind=True, unique="key")
def uq_stops_broker(self: Task, key: str) -> str:
    """Unique, acks_late: its first run stops (SIGSTOP) the broker as it returns, so the
    ack that follows is the worker's first call to a stopped broker: it is written on
    the connection kombu keeps open, and read by the broker when it goes on."""
    observer().run(key, task_id=self.request.id)
    if marks().set(f"ackfail:broker-stopped:{key}", "1", nx=True):  # the key's first run
        os.kill(int(marks().get(broker_pid_mark()) or 0), signal.SIGSTOP)
    return "ran"


def unique_key(task: Task, *args: object, **kwargs: object) -> str:
    """The store key of ``task``'s unique claim for this call."""
    policy = baton.policy_for(task)
    assert policy is not None
    return policy.unique_key(baton.names, args, kwargs)


def main_stopped_mark(key: str) -> str:
    """Set by the first run of a ``*_main_dies`` task with ``key`` when it stopped its
    main process (only the first: a later run of the key must end normally)."""
    return f"ackfail:main-stopped:{key}"


def _first_run_stops_its_main_process(key: str) -> None:
    if marks().set(main_stopped_mark(key), str(os.getppid()), nx=True):
        os.kill(os.getppid(), signal.SIGSTOP)


@app.task(bind=True, redelivery_guard=True)
def guarded_main_dies(self: Task, key: str) -> str:
    """Guarded: its first run ends after its worker's main process stopped."""
    observer().run(key, task_id=self.request.id)
    _first_run_stops_its_main_process(key)
    return "ran"


@app.task(bind=True, unique="key", redelivery_guard=True)
def unique_main_dies(self: Task, key: str) -> str:
    """Unique and guarded: the same."""
    observer().run(key, task_id=self.request.id)
    _first_run_stops_its_main_process(key)
    return "ran"
