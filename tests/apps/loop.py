"""A Celery app with celery-baton installed: the worker's consumer loop under test.

Run by workers as ``celery -A tests.apps.loop worker``. Reads ``TEST_BROKER_URL``,
``TEST_RESULT_URL``, ``TEST_OBSERVER_URL`` and ``BATON_URL`` (the store under test) from
the environment, and ``BATON_TEST_ON_STORE_ERROR`` (``baton_on_store_error``, default
``"hold"``).

``baton_global_rate_limits`` is on and no task declares Celery's ``rate_limit``: a
test sets one at runtime with ``app.control.rate_limit``. ``baton_socket_timeout`` is
1 s, so a paused store breaks the worker's channel within a second or two.

Every task reports its run to the :class:`~tests.support.observer.Observer` (server
clock), whose key says which task ran. In the test process, import it inside a test
that uses the ``app_environ`` fixture.
"""

from __future__ import annotations

import os

from celery import Task

from tests.apps.factory import make_baton_app, observer

app, baton = make_baton_app(
    "loop",
    baton_socket_timeout=1.0,
    baton_global_rate_limits=True,
    baton_on_store_error=os.environ.get("BATON_TEST_ON_STORE_ERROR", "hold"),
    task_acks_late=False,
    task_ignore_result=True,
    broker_transport_options={"visibility_timeout": 3600},
    # Publishes to this queue wait there until a test makes a worker consume it.
    task_routes={"tests.apps.loop.unique_later": {"queue": "later"}},
)


@app.task(bind=True)
def hit(self: Task) -> None:
    """No option at all: only a runtime ``rate_limit`` can limit it."""
    observer().run("hit", task_id=self.request.id)


@app.task(bind=True)
def plain(self: Task) -> None:
    """No coordination: its start delay shows whether the consumer's loop is free."""
    observer().run("plain", task_id=self.request.id)


@app.task(bind=True, unique="key")
def unique_later(self: Task, key: str) -> None:
    """Unique, routed to the ``later`` queue (consumed only when a test says so)."""
    observer().run(f"unique:{key}", task_id=self.request.id)


@app.task(bind=True, exclusive="key")
def exclusive_skip(self: Task, key: str) -> None:
    """Exclusive with the default conflict policy (skip) and ``lease_ttl`` (30 s)."""
    observer().run(key, task_id=self.request.id)
