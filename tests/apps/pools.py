"""Tasks under test on every way Celery runs a task: prefork, threads, gevent, eventlet,
solo (``celery -A tests.apps.pools worker -P <pool>``).

Reads the URLs of :func:`tests.support.celery_processes.app_env`. Every run is recorded
by the :class:`~tests.support.observer.Observer` on its server's clock. A stoppable run
(:func:`replaced`, :func:`stoppable`) also writes a heartbeat every 20 ms while it runs
and, when it is stopped, a cleanup of ``cleanup`` seconds in its ``finally`` that writes
its last heartbeat at the end: the run's body has ended only then, and the next holder of
its key must not start before (``observer:last:<key>`` keeps each run's last write).
"""

from __future__ import annotations

import functools
import os
import time

import redis
from celery import Task

from celery_baton import fence
from tests.apps.factory import make_baton_app, observer

app, baton = make_baton_app(
    "pools",
    baton_socket_timeout=1.0,
    task_acks_late=False,
    worker_prefetch_multiplier=1,
    broker_transport_options={"visibility_timeout": 3600},
    worker_lost_wait=1.0,
    # The limited task has a queue of its own: a threads or solo worker consumes it
    # alone, since it refuses to start on a queue of "replace" tasks.
    task_routes={
        "tests.apps.pools.capped": {"queue": "capped"},
        "tests.apps.pools.stoppable": {"queue": "stoppable"},
        "tests.apps.pools.unique_late": {"queue": "stoppable"},
    },
)
CAPPED_QUEUE = "capped"
STOPPABLE_QUEUE = "stoppable"

BEAT_EVERY = 0.02
# KEYS[1] the last-write hash of a key; ARGV[1] the task id. Sets the id's field to the
# observer server's TIME (microseconds).
_LAST_WRITE = """
local t = redis.call('TIME')
redis.call('HSET', KEYS[1], ARGV[1], t[1] .. string.rep('0', 6 - #t[2]) .. t[2])
"""


@functools.cache
def _last_write() -> redis.commands.core.Script:
    client = redis.Redis.from_url(os.environ["TEST_OBSERVER_URL"])
    return client.register_script(_LAST_WRITE)


def last_writes(client: redis.Redis, key: str) -> dict[str, int]:
    """The last write of each task id that ran ``key`` (observer server time, us)."""
    writes = client.hgetall(f"observer:last:{key}")
    return {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in writes.items()}


@app.task(bind=True, global_concurrency=2)
def capped(self: Task, sleep: float) -> None:
    """At most 2 running anywhere."""
    observer().run("capped", sleep=sleep, task_id=self.request.id)


def _stoppable_run(task: Task, key: str, n: int, sleep: float, cleanup: float) -> int:
    write = functools.partial(_last_write(), keys=[f"observer:last:{key}"], args=[task.request.id])
    with observer().track(key, fence(), task_id=f"{task.request.id}:{n}"):
        try:
            deadline = time.monotonic() + sleep
            while time.monotonic() < deadline:
                write()
                time.sleep(BEAT_EVERY)
        except BaseException:
            # Stopped (a green pool raises GreenletExit here): the body cleans up, as
            # real ones do (a rollback, a file closed), and writes once more at its end.
            time.sleep(cleanup)
            write()
            raise
        write()
    return n


@app.task(bind=True, exclusive="key", exclusive_conflict="replace", lease_ttl=3)
def replaced(self: Task, key: str, n: int, sleep: float = 0.0, cleanup: float = 0.0) -> int:
    """A newer publish terminates the running one and runs instead."""
    return _stoppable_run(self, key, n, sleep, cleanup)


@app.task(bind=True, exclusive="key", exclusive_conflict="wait", lease_ttl=3)
def stoppable(self: Task, key: str, n: int, sleep: float = 0.0, cleanup: float = 0.0) -> int:
    """Waits for its key; ``revoke(terminate=True)`` stops a run."""
    return _stoppable_run(self, key, n, sleep, cleanup)


@app.task(bind=True, exclusive="key", unique="key", acks_late=True, lease_ttl=3)
def unique_late(self: Task, key: str, n: int, sleep: float = 0.0, cleanup: float = 0.0) -> int:
    """Acked at its end (the ack queued on the worker's loop), its unique claim freed
    then: what frees the claim waits for that ack."""
    return _stoppable_run(self, key, n, sleep, cleanup)
