"""A Celery app with celery-baton installed: held requests and the prefetch window on
RabbitMQ (issue 35 §4).

Run by workers as ``celery -A tests.apps.held_window worker``. Reads the usual
``TEST_*`` variables and ``BATON_URL``, and these knobs:

* ``HELD_QUEUE`` -- the default queue's name (unique per test: a queue's type cannot
  change once declared);
* ``HELD_QUEUE_TYPE`` -- ``quorum`` or ``classic`` (default);
* ``HELD_SINGLE_ACTIVE`` -- ``"1"``: the queue has a single active consumer;
* ``HELD_PER_CONSUMER`` -- ``"1"``: kombu reads the broker as RabbitMQ 4, which has no
  global QoS on any queue type, so every prefetch is per consumer (kombu's
  ``qos_semantics_matches_spec``), also on the RabbitMQ 3 of the test machine;
* ``HELD_ETA_LIMIT`` -- Celery's ``worker_eta_task_limit`` (5.5+): the prefetch count
  that ETA tasks (and held requests, counted like them) may raise it to;
* ``HELD_SLOW_EXIT`` -- seconds a leaving pool process takes to exit (its
  ``worker_process_shutdown`` handler sleeps): with ``--max-tasks-per-child`` its
  replacement comes that much later.

Celery's defaults otherwise, except ``worker_prefetch_multiplier = 4`` (the issue's
setting). Every task reports its start to the observer.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Task, signals
from kombu import Queue

from tests.apps.factory import make_baton_app, observer

QUEUE = os.environ.get("HELD_QUEUE", "celery")
QUEUE_TYPE = os.environ.get("HELD_QUEUE_TYPE", "classic")


def queue_arguments(queue_type: str, single_active: bool) -> dict[str, object]:
    """The default queue's arguments (the test's publisher declares it alike)."""
    arguments: dict[str, object] = {"x-queue-type": queue_type}
    if single_active:
        arguments["x-single-active-consumer"] = True
    return arguments


if os.environ.get("HELD_PER_CONSUMER") == "1":
    from kombu.transport import pyamqp

    # RabbitMQ 4 reports its version and kombu answers True: per-consumer prefetch.
    pyamqp.Transport.qos_semantics_matches_spec = lambda self, connection: True

app, baton = make_baton_app(
    "held_window",
    baton_socket_timeout=1.0,
    task_ignore_result=True,
    task_default_queue=QUEUE,
    task_queues=[
        Queue(
            QUEUE,
            queue_arguments=queue_arguments(
                QUEUE_TYPE, os.environ.get("HELD_SINGLE_ACTIVE") == "1"
            ),
        )
    ],
    worker_prefetch_multiplier=4,
)
if os.environ.get("HELD_ETA_LIMIT"):
    app.conf.worker_eta_task_limit = int(os.environ["HELD_ETA_LIMIT"])


_SLOW_EXIT = float(os.environ.get("HELD_SLOW_EXIT", "0"))
if _SLOW_EXIT:

    @signals.worker_process_shutdown.connect(weak=False)
    def _exit_slowly(**_: Any) -> None:
        time.sleep(_SLOW_EXIT)


@app.task(bind=True, global_rate_limit="2/s")
def paced(self: Task, n: int) -> None:
    """Two starts per second across all workers: a backlog of them is held."""
    observer().run("paced", task_id=self.request.id)


@app.task(bind=True)
def quick(self: Task, n: int) -> None:
    """A plain task: no limit, nothing to wait for."""
    observer().run("quick", task_id=self.request.id)
