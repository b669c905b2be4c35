"""A Celery app with the redelivery guard on, whose tasks publish task ids again on purpose.

Run by workers as ``celery -A tests.apps.republish worker``. Reads ``TEST_BROKER_URL``,
``TEST_RESULT_URL``, ``TEST_OBSERVER_URL`` and ``BATON_URL`` from the environment.
Celery's defaults otherwise (acks on receipt, prefetch 4), and
``baton_redelivery_guard = True``; with ``REPUBLISH_ACKS_LATE=1`` every task is
``acks_late`` with ``reject_on_worker_lost`` (the setting the guard is made for).

Celery itself sends a task id again in several ordinary ways: ``Task.replace()``
freezes the replacement with the replaced task's id (for a chain, its last task); a
frozen chord or signature applied twice, or one frozen errback linked in two canvases,
sends the same ids again; and a caller may pass ``apply_async(task_id=...)``. Each is a
new publish, not a redelivered copy: it must run.

Every task reports its run to the :class:`~tests.support.observer.Observer` under the
``key`` it is given, so a test counts runs from outside the library.

In the test process, import it inside a test that uses the ``app_environ`` fixture.
"""

from __future__ import annotations

import os
import time

from celery import Task, chain

from tests.apps.factory import make_baton_app, observer

_ACKS_LATE = {"task_acks_late": True, "task_reject_on_worker_lost": True}
app, baton = make_baton_app(
    "republish",
    baton_redelivery_guard=True,
    **(_ACKS_LATE if os.environ.get("REPUBLISH_ACKS_LATE") == "1" else {}),
)


@app.task(bind=True)
def add(self: Task, x: int, y: int, key: str = "add") -> int:
    observer().run(key, task_id=self.request.id)
    return x + y


@app.task(bind=True)
def total(self: Task, numbers: list[int], key: str) -> int:
    """A chord's body."""
    observer().run(key, task_id=self.request.id)
    return sum(numbers)


@app.task(bind=True)
def countdown(self: Task, n: int, key: str) -> int:
    """Replaces itself with itself ``n`` times (Celery gives each replacement this task
    id); the last run returns its replacement depth."""
    observer().run(key, task_id=self.request.id)
    if n > 0:
        return self.replace(self.si(n - 1, key))  # type: ignore[no-any-return]
    return int(self.request.replaced_task_nesting or 0)


@app.task(bind=True)
def countdown_by_chain(self: Task, n: int, key: str) -> int:
    """Replaces itself with a chain that ends in itself (the chain's last task takes this
    task id), ``n`` times."""
    observer().run(key, task_id=self.request.id)
    if n > 0:
        return self.replace(  # type: ignore[no-any-return]
            chain(add.si(n, 0, f"{key}:add"), self.si(n - 1, key))
        )
    return int(self.request.replaced_task_nesting or 0)


@app.task(bind=True)
def replaces_slowly(self: Task, n: int, key: str, linger: float) -> int:
    """Replaces itself, then lingers ``linger`` seconds before its run ends: the
    replacement arrives while this run still holds the guard's lease on the task id."""
    with observer().track(key, task_id=self.request.id):
        if n > 0:
            try:
                self.replace(self.si(n - 1, key, linger))  # sends it, then raises Ignore
            finally:
                time.sleep(linger)
    return n


@app.task(bind=True)
def fails(self: Task, key: str) -> None:
    observer().run(key, task_id=self.request.id)
    raise ValueError("fails on purpose")


@app.task(bind=True)
def on_error(self: Task, failed_id: str, key: str) -> None:
    """An old-style errback (the failed task's id first): Celery sends it as a message."""
    observer().run(key, task_id=self.request.id)
