"""A Celery app with celery-baton installed whose broker the test pauses mid-drain
(worker/transport/broker_writes.py: kombu's records and acks sent without waiting).

Run by workers as ``celery -A tests.apps.broker_writes worker``. Reads
``TEST_BROKER_URL``, ``TEST_OBSERVER_URL`` and ``BATON_URL`` from the environment.

Celery's defaults (prefetch, early acks), with a broker connection whose
``socket_timeout`` is short, so that a write to a paused broker is given up within
seconds, and a short ``visibility_timeout`` with a restore scan every second, so that a
message whose ack did not land comes back within seconds. Each run records its task id
and its message's delivery tag (``tags``), so that a test can tell which failed ack
("Couldn't ack <tag>") a second run of a task id follows.

In the test process, import it inside a test that uses the ``app_environ`` fixture.
"""

from __future__ import annotations

from typing import Any

from celery import Task
from celery.signals import task_received

from tests.apps.factory import PAUSABLE_BROKER, make_baton_app, marks, observer

app, baton = make_baton_app(
    "broker_writes",
    results=False,
    task_ignore_result=True,  # (the result backend would live on the paused server)
    broker_transport_options=PAUSABLE_BROKER,
)

TAGS = "broker_writes:tags"


@task_received.connect
def _tagged(request: Any = None, **_: Any) -> None:
    """The main process, as it receives a call: its message's delivery tag (what a
    failed ack names) in the request's ``delivery_info``, which Celery does not copy
    there, so that the body can record it."""
    delivery_info = getattr(request, "delivery_info", None)
    message = getattr(request, "message", None)
    if isinstance(delivery_info, dict) and message is not None:
        delivery_info["delivery_tag"] = message.delivery_tag


def _ran(task: Task, i: int, seconds: float = 0.01) -> None:
    observer().run(f"s{i}", task_id=task.request.id, sleep=seconds)
    tag = (task.request.delivery_info or {}).get("delivery_tag", "")
    marks().rpush(TAGS, f"{task.request.id} {tag}")


@app.task(bind=True)
def step(self: Task, i: int) -> None:
    """Any task: the writes are the transport's, guarded or not."""
    _ran(self, i)


@app.task(bind=True, redelivery_guard=True)
def guarded_step(self: Task, i: int) -> None:
    """Under the redelivery guard: a message delivered again does not run twice."""
    _ran(self, i)


@app.task(bind=True)
def long_step(self: Task, i: int, seconds: float) -> None:
    """A body of ``seconds``: on solo, the worker's loop reads nothing meanwhile."""
    _ran(self, i, seconds)
