"""A Celery app with celery-baton installed: exclusive and unique tasks under test.

Run by workers as ``celery -A tests.apps.exclusive worker``. Reads ``TEST_BROKER_URL``,
``TEST_RESULT_URL``, ``TEST_OBSERVER_URL`` and ``BATON_URL`` (the store under test) from
the environment, and these knobs:

* ``BATON_TEST_LEASE_TTL`` -- the ``lease_ttl`` of :func:`ex_long` (default 3 s);
* ``BATON_TEST_APP_LEASE_TTL`` -- ``baton_lease_ttl``, every task's (default: the default);
* ``BATON_TEST_SOCKET_TIMEOUT`` -- ``baton_socket_timeout`` (default 1 s).

Every task reports its run to the :class:`~tests.support.observer.Observer` with its key
and, for exclusive tasks, ``fence()``: the observer, not the library, judges overlaps.
A run's start entry carries its pid, so a test can SIGKILL the pool child running it.

In the test process, import it inside a test that uses the ``app_environ`` fixture.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Task
from celery.exceptions import Ignore, Reject

from celery_baton import fence
from tests.apps.factory import fenced_run, make_baton_app, observer

app, baton = make_baton_app(
    "exclusive",
    baton_socket_timeout=float(os.environ.get("BATON_TEST_SOCKET_TIMEOUT", "1")),
    baton_on_store_error=os.environ.get("BATON_TEST_ON_STORE_ERROR", "hold"),
    baton_metrics_port=os.environ.get("BATON_TEST_METRICS_PORT"),
    # The app-wide lease_ttl (None: the default), for tests of a long one.
    baton_lease_ttl=os.environ.get("BATON_TEST_APP_LEASE_TTL"),
    task_acks_late=False,
    worker_prefetch_multiplier=1,
    broker_transport_options={"visibility_timeout": 3600},
    # Celery waits this long after a pool child died before it fails the job with
    # WorkerLostError (default 10 s); the lease is released on that path.
    worker_lost_wait=1.0,
    # Publishes to this queue stay queued: no test worker consumes it.
    task_routes={"tests.apps.exclusive.uq_idle": {"queue": "idle"}},
    # The pool_restart remote command (tests/pools/test_pool_restart.py).
    worker_pool_restarts=os.environ.get("TEST_POOL_RESTARTS") == "1",
)

LEASE_TTL = float(os.environ.get("BATON_TEST_LEASE_TTL", "3"))


# -- exclusive ---------------------------------------------------------------------------


@app.task(bind=True, exclusive="key", exclusive_conflict="wait")
def ex_wait(self: Task, key: str, sleep: float = 0.0) -> int:
    """One observed run of ``key``; a duplicate waits in the consumer."""
    return fenced_run(self, key, sleep)


@app.task(bind=True, exclusive="key")
def ex_skip(self: Task, key: str, sleep: float = 0.0) -> int:
    """One observed run of ``key``; a duplicate is skipped."""
    return fenced_run(self, key, sleep)


@app.task(bind=True, exclusive=lambda key, divisor=1: f"{key}/{1 // divisor}")
def ex_by_function(self: Task, key: str, divisor: int = 1) -> int:
    """A key built by a function of the app's own, which raises for ``divisor=0``."""
    return fenced_run(self, key, 0.0)


@app.task(bind=True, exclusive="{key}-{n:05d}")
def ex_by_format(self: Task, key: str, n: object = 0) -> int:
    """A key template whose format spec raises ValueError for an ``n`` not an int."""
    return fenced_run(self, key, 0.0)


@app.task(bind=True, exclusive="key", exclusive_conflict="wait", lease_ttl=LEASE_TTL)
def ex_long(self: Task, key: str, sleep: float = 0.0) -> int:
    """Like :func:`ex_wait` with a short ``lease_ttl``: runs may outlast it many times."""
    return fenced_run(self, key, sleep)


class _SlowAfterReturn(Task):  # type: ignore[misc]
    """Its run's end lingers after the result is stored (``after_return`` comes before
    ``task_postrun``): another run on the same thread pool or greenlet hub goes on
    meanwhile."""

    def after_return(self, *args: Any, **kwargs: Any) -> None:
        time.sleep(0.5)  # cooperative on the green pools (Celery patches them)


@app.task(bind=True, base=_SlowAfterReturn, exclusive="key", exclusive_conflict="wait")
def ex_slow_end(self: Task, key: str, sleep: float = 0.0) -> int:
    """Like :func:`ex_wait`, its end lingering 0.5 s after its result."""
    return fenced_run(self, key, sleep)


@app.task(
    bind=True,
    exclusive="key",
    exclusive_conflict="wait",
    acks_late=True,
    reject_on_worker_lost=True,
)
def ex_late(self: Task, key: str, sleep: float = 0.0) -> int:
    """Like :func:`ex_wait`, but redelivered when its pool child is killed."""
    return fenced_run(self, key, sleep)


# -- the failure matrix: exclusive on ``key``, unique on ``key`` and ``n`` ----------------


def _matrix(task: Task, key: str, mode: str, arg: float) -> str:
    with observer().track(key, fence(), task_id=task.request.id):
        if mode == "retry" and task.request.retries < 1:
            raise task.retry(countdown=arg)
        if mode == "retry_held" and task.request.retries < 1:
            # The retry is queued while this run still holds the key for ``arg`` s.
            retry = task.retry(countdown=0, throw=False)
            time.sleep(arg)
            raise retry
        if mode == "retry_forever":
            raise task.retry(countdown=0, max_retries=1)
        if mode == "fail_once" and task.request.retries < 1:
            raise ValueError("first attempt fails")
        if mode == "reject":
            raise Reject("rejected by the test", requeue=False)
        if mode == "ignore":
            raise Ignore()
        if mode == "sleep":
            time.sleep(arg)
        return mode


@app.task(bind=True, exclusive="key", unique=["key", "n"])
def mx_skip(self: Task, key: str, mode: str = "ok", arg: float = 0.0, n: int = 0) -> str:
    """Exclusive (skip) and unique; ``mode`` picks how the run ends."""
    return _matrix(self, key, mode, arg)


@app.task(bind=True, exclusive="key", exclusive_conflict="wait", unique=["key", "n"])
def mx_wait(self: Task, key: str, mode: str = "ok", arg: float = 0.0, n: int = 0) -> str:
    """Exclusive (wait) and unique; ``mode`` picks how the run ends."""
    return _matrix(self, key, mode, arg)


@app.task(
    bind=True,
    exclusive="key",
    unique=["key", "n"],
    autoretry_for=(ValueError,),
    retry_kwargs={"countdown": 0},
    max_retries=2,
)
def mx_auto(self: Task, key: str, mode: str = "ok", arg: float = 0.0, n: int = 0) -> str:
    """``autoretry_for=(ValueError,)``: mode ``fail_once`` is retried by Celery."""
    return _matrix(self, key, mode, arg)


# -- unique --------------------------------------------------------------------------------


@app.task(bind=True, unique="key")
def uq(self: Task, key: str, sleep: float = 0.0) -> str:
    """Unique until finished."""
    observer().run(key, sleep=sleep, task_id=self.request.id)
    return str(self.request.id)


@app.task(bind=True, unique="key", unique_until="started")
def uq_started(self: Task, key: str, sleep: float = 0.0) -> str:
    """Unique until started."""
    observer().run(key, sleep=sleep, task_id=self.request.id)
    return str(self.request.id)


@app.task(bind=True, unique="key")
def uq_idle(self: Task, key: str, extra: Any = None) -> str:
    """Unique, routed to the ``idle`` queue that no test worker consumes."""
    return str(self.request.id)


@app.task(bind=True, unique="key", unique_ttl=2, queue="idle")
def uq_idle_short(self: Task, key: str) -> str:
    """``uq_idle`` with a claim that lasts 2 s (``unique_ttl``), in the same idle queue."""
    return str(self.request.id)


@app.task(bind=True, exclusive="key")
def ex_unfenced(self: Task, key: str) -> str:
    """Exclusive, but reads no fence: it may run unguarded (baton_on_store_error="run")."""
    observer().run(key, task_id=self.request.id)
    return str(self.request.id)


@app.task
def plain(value: Any = None) -> Any:
    """No coordination at all."""
    return value


# -- for the tests: where a call's keys live in the store, and who holds them -------------


def exclusive_key(task: Task, *args: Any, **kwargs: Any) -> str:
    """The store key of the exclusive lease that ``task(*args, **kwargs)`` takes."""
    policy = baton.policy_for(task)
    assert policy is not None and policy.exclusive is not None
    return baton.names.lease(task.name, "ex", policy.exclusive.key(args, kwargs))


def unique_key(task: Task, *args: Any, **kwargs: Any) -> str:
    """The store key that a publish of ``task(*args, **kwargs)`` claims."""
    policy = baton.policy_for(task)
    assert policy is not None and policy.unique is not None
    return policy.unique_key(baton.names, args, kwargs)


def live_owners(client: Any, key: str) -> dict[str, int]:
    """The live owners of a lease key, ``{owner: fence}``, judged by the server's clock.

    ``client`` is a ``decode_responses=True`` client of the store.
    """
    seconds, micros = client.time()
    now_ms = seconds * 1000 + micros // 1000
    owners = {}
    for field, value in client.hgetall(key).items():
        if field.startswith("o:"):
            deadline, token = value.split()
            if int(deadline) > now_ms:
                owners[field[2:]] = int(token)
    return owners
