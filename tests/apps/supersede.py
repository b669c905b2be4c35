"""Supersede modes under test (issue 15 §4): replace, keep_last, unique replace.

Run by workers as ``celery -A tests.apps.supersede worker``; reads the URLs of
:func:`tests.support.celery_processes.app_env`. Every run is recorded by the observer
with its argument ``n`` in the task id's entry, and while it runs it writes a heartbeat (the
observer server's ``TIME``) every 20 ms: a run that was terminated leaves its last
heartbeat behind, so the test can see from outside when it really stopped.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import time

import redis
from celery import Task

from celery_baton import fence
from tests.apps.factory import make_baton_app, observer

app, baton = make_baton_app(
    "supersede",
    baton_socket_timeout=1.0,
    task_acks_late=False,
    worker_lost_wait=1.0,
    broker_transport_options={
        "visibility_timeout": float(os.environ.get("BATON_TEST_VISIBILITY", "3600"))
    },
    # Workers that take no remote control commands (no pidbox queue).
    worker_enable_remote_control=os.environ.get("SUPERSEDE_REMOTE_CONTROL", "1") == "1",
)

BEAT_EVERY = 0.02
# KEYS[1] the heartbeat list of a key; ARGV[1] the task id. Appends {t, id}, t the
# observer server's TIME in microseconds.
_BEAT = """
local t = redis.call('TIME')
redis.call('RPUSH', KEYS[1], '{"t":' .. t[1] .. string.rep('0', 6 - #t[2]) .. t[2] ..
  ',"id":"' .. ARGV[1] .. '"}')
"""


@functools.cache
def _beat_script() -> redis.commands.core.Script:
    client = redis.Redis.from_url(os.environ["TEST_OBSERVER_URL"])
    return client.register_script(_BEAT)


def heartbeats(client: redis.Redis, key: str) -> dict[str, int]:
    """The last heartbeat of each task id that ran ``key`` (observer server time, us)."""
    last: dict[str, int] = {}
    for raw in client.lrange(f"observer:beats:{key}", 0, -1):
        beat = json.loads(raw)
        last[beat["id"]] = max(last.get(beat["id"], 0), beat["t"])
    return last


def _observed_run(task: Task, key: str, n: int, sleep: float) -> int:
    token = fence() if task.request.get("baton_fence") else None
    with observer().track(key, token, task_id=f"{task.request.id}:{n}"):
        deadline = time.monotonic() + sleep
        while True:
            _beat_script()(keys=[f"observer:beats:{key}"], args=[task.request.id])
            if time.monotonic() >= deadline:
                break
            time.sleep(BEAT_EVERY)
    return n


@app.task(bind=True, exclusive="key", exclusive_conflict="replace", lease_ttl=3)
def ex_replace(self: Task, key: str, n: int, sleep: float = 0.0) -> int:
    """A newer publish terminates the running one and runs instead."""
    return _observed_run(self, key, n, sleep)


@app.task(bind=True, exclusive="key", exclusive_conflict="keep_last")
def ex_keep(self: Task, key: str, n: int, sleep: float = 0.0) -> int:
    """One running, one queued: the newest publish waiting replaces the older ones."""
    return _observed_run(self, key, n, sleep)


@app.task(bind=True, unique="key", unique_conflict="replace")
def uq_replace(self: Task, key: str, n: int, sleep: float = 0.0) -> int:
    """A newer publish replaces the queued one's arguments."""
    return _observed_run(self, key, n, sleep)


@app.task(bind=True, exclusive="key")
def ex_plain(self: Task, key: str, n: int, sleep: float = 0.0) -> int:
    """Declared ``skip``: a call may make it superseding with ``baton={...}``."""
    return _observed_run(self, key, n, sleep)


@app.task(bind=True, exclusive="key", exclusive_conflict="wait")
def ex_stubborn(self: Task, key: str, n: int, sleep: float = 0.0) -> int:
    """Traps SIGTERM: ``revoke(terminate=True)`` (SIGTERM) does not stop the run."""
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        return _observed_run(self, key, n, sleep)
    finally:
        signal.signal(signal.SIGTERM, previous)


@app.task(bind=True, exclusive="key", exclusive_conflict="keep_last")
def ex_keep_retry(self: Task, key: str, n: int, sleep: float = 0.0) -> int:
    """keep_last; its first attempt retries after ``sleep`` s (the retry is published
    while a newer publish waits)."""
    if self.request.retries == 0:
        _observed_run(self, key, n, sleep)
        raise self.retry(countdown=0.2)
    return _observed_run(self, key, n, 0)
