"""The one place the test apps are built: broker, results and store from the environment.

Every app module under ``tests.apps`` reads its servers from the variables that
:func:`tests.support.celery_processes.app_env` (and the ``app_environ`` fixture) set:
``TEST_BROKER_URL``, ``TEST_RESULT_URL``, ``TEST_OBSERVER_URL`` and ``BATON_URL``.
:func:`make_app` builds a plain Celery app on them, :func:`make_baton_app` the same with
celery-baton installed; each app module passes only its own settings, so what is
particular to a test app stays in its module.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
from typing import Any

import redis
from celery import Celery
from celery.signals import after_setup_logger

from celery_baton import Baton, fence
from tests.support.observer import Observer

#: A Redis broker whose writes fail within seconds when it is paused, and whose unacked
#: messages come back within seconds (10 s visibility, a restore scan every second).
PAUSABLE_BROKER = {
    "visibility_timeout": 10,
    "socket_timeout": 1,
    "socket_connect_timeout": 1,
    "unacked_restore_interval": 1,
    "unacked_restore_throttle": 1,
    # A worker stopped or killed while it held kombu's restore lock keeps every message
    # from coming back until the lock expires (300 s by default).
    "unacked_mutex_expire": 5,
}


def make_app(name: str, *, results: bool = True, **conf: Any) -> Celery:
    """A Celery app named ``name`` on ``$TEST_BROKER_URL``, with ``$TEST_RESULT_URL`` as
    its result backend when ``results``, retrying the broker at start, and ``conf``."""
    backend = os.environ.get("TEST_RESULT_URL") if results else None
    app = Celery(name, broker=os.environ["TEST_BROKER_URL"], backend=backend)
    app.conf.update(broker_connection_retry_on_startup=True, **conf)
    return app


def make_baton_app(
    name: str,
    *,
    results: bool = True,
    store_from_env: bool = True,
    url: str | None = None,
    **conf: Any,
) -> tuple[Celery, Baton]:
    """:func:`make_app` with celery-baton installed: ``(app, baton)``.

    The store is ``$BATON_URL`` (as ``baton_url``) unless ``store_from_env`` is false:
    then the app names it only through ``url`` (given to ``Baton``) or not at all, as the
    tests of how the store is found need."""
    if store_from_env:
        conf = {"baton_url": os.environ["BATON_URL"], **conf}
    app = make_app(name, results=results, **conf)
    return app, Baton(app, url=url)


class _StopAtLine(logging.Handler):
    """Stops this process (SIGSTOP), once, as it logs a line holding ``text``: the whole
    worker stands still at that very point (swapped out, starved on a loaded machine)
    until the test lets it go on (SIGCONT)."""

    def __init__(self, text: str) -> None:
        super().__init__(logging.DEBUG)
        self.text = text
        self.stopped = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.stopped and self.text in record.getMessage():
            self.stopped = True
            os.kill(os.getpid(), signal.SIGSTOP)


@after_setup_logger.connect
def _baton_debug(**_: object) -> None:
    """In a worker's environment, ``TEST_BATON_DEBUG=1``: celery_baton's DEBUG lines in
    its log (the path a delivery took: a test waits for one, or reads a failing run);
    ``TEST_STOP_AT_LINE``: the worker stops as it logs a celery_baton line holding it
    (DEBUG lines included)."""
    baton_logger = logging.getLogger("celery_baton")
    stop_at = os.environ.get("TEST_STOP_AT_LINE")
    if os.environ.get("TEST_BATON_DEBUG") or stop_at:
        baton_logger.setLevel(logging.DEBUG)
    if stop_at:
        baton_logger.addHandler(_StopAtLine(stop_at))


@functools.cache
def observer() -> Observer:
    """This process's Observer (created at its first use, after the pool forked, so a
    pool process never shares its parent's)."""
    return Observer(os.environ["TEST_OBSERVER_URL"])


def fenced_run(task: Any, key: str, sleep: float = 0.0) -> int:
    """One observed run of ``key`` by ``task`` (bound, exclusive): the fencing token of
    its lease, recorded with the run and returned."""
    token = fence()
    observer().run(key, token, sleep=sleep, task_id=task.request.id)
    return token


@functools.cache
def marks() -> redis.Redis:
    """The observer's database, for marks a task leaves for its own next delivery or for
    the test (created at its first use, in the process that uses it, as observer())."""
    return redis.Redis.from_url(os.environ["TEST_OBSERVER_URL"], decode_responses=True)
