"""A Celery app with celery-baton installed: lease renewal racing a release (issue 11.2).

Run by workers as ``celery -A tests.apps.renewal worker``. Reads ``TEST_BROKER_URL``,
``TEST_RESULT_URL``, ``TEST_OBSERVER_URL`` and ``BATON_URL`` (the store under test) from
the environment.

``baton_lease_ttl`` is 3 s, so the worker renews its leases every second, and the store's
socket timeout is 2 s: a test can place a store stall around a renewal. :func:`hold`
runs until the test says so (:func:`let_finish`), so the test decides when its release
is sent, whatever the load of the machine.

In the test process, import it inside a test that uses the ``app_environ`` fixture.
"""

from __future__ import annotations

import os
import time

import redis
from celery import Task

from celery_baton import fence
from tests.apps.factory import make_baton_app, observer

LEASE_TTL = 3.0

app, baton = make_baton_app(
    "renewal",
    baton_socket_timeout=2.0,
    baton_lease_ttl=LEASE_TTL,
    task_acks_late=False,
)


def _finish_flag(key: str) -> str:
    return f"renewal:finish:{key}"


def let_finish(key: str) -> None:
    """Tell the running :func:`hold` of ``key`` to finish (from the test process)."""
    with redis.Redis.from_url(os.environ["TEST_OBSERVER_URL"]) as r:
        r.set(_finish_flag(key), "1")


@app.task(bind=True, exclusive="key")
def hold(self: Task, key: str, wait: bool = False) -> int:
    """One observed run of ``key`` (a duplicate is skipped); with ``wait`` it lasts until
    :func:`let_finish` (at most 60 s)."""
    token = fence()
    with observer().track(key, token, task_id=self.request.id):
        if wait:
            flags = redis.Redis.from_url(os.environ["TEST_OBSERVER_URL"])
            deadline = time.monotonic() + 60
            while not flags.get(_finish_flag(key)) and time.monotonic() < deadline:
                time.sleep(0.02)
            flags.close()
    return token


def exclusive_key(key: str) -> str:
    """The store key of the exclusive lease that ``hold(key)`` takes."""
    policy = baton.policy_for(hold)
    assert policy is not None and policy.exclusive is not None
    return baton.names.lease(hold.name, "ex", policy.exclusive.key((key,), {}))
