"""Polling helpers for tests that wait on real processes."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def wait_until(
    predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.05
) -> float:
    """Poll ``predicate`` until it is true; return the seconds it took.

    Raises ``AssertionError`` naming ``what`` after ``timeout`` seconds.
    """
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(interval)
    return time.monotonic() - start


def revoke_until_heard(app: Any, task_id: str, *, terminate: bool, timeout: float = 20) -> None:
    """``app.control.revoke`` until a worker answers it. On a Redis broker a broadcast
    is published to the workers' control consumers as they listen now: one made just
    after a worker said it is ready, before its control consumer listens, is lost (a
    loaded run's gevent worker never heard its revoke, and the test waited in vain). Sent
    through :func:`broadcast`: a CI rehearsal's revoke failed on a pooled connection the
    broker had closed."""
    wait_until(
        lambda: broadcast(
            app, lambda: app.control.revoke(task_id, terminate=terminate, reply=True, timeout=1.0)
        ),
        timeout,
        f"a worker answered the revoke of {task_id}",
        interval=0.0,
    )


def broadcast(app: Any, send: Callable[[], T]) -> T:
    """``send()`` a control broadcast of ``app``, once more on a broker connection error:
    the test process's pooled connection may have been closed by the server since its
    last use (an earlier test of this process restarted the broker), which is the test's
    own client failing, not the system under test."""
    try:
        return send()
    except app.connection_for_read().connection_errors:
        return send()
