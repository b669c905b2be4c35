"""A debounced (or throttle-trailing) run stands for the publishes it superseded.

The consumer puts their task ids on the run's request (``STANDS_FOR_FIELD``); when the
task ends in the pool, its outcome is written to each of them through the result
backend, so ``AsyncResult(superseded_id).get()`` returns the run's result (or raises its
error). Without a result backend (or with ``ignore_result``) nothing is written: there
is no result to wait for anyway.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import signals, states
from celery.backends.base import DisabledBackend

logger = logging.getLogger("celery_baton.worker")

STANDS_FOR_FIELD = "baton_stands_for"


def write_stand_in_results(
    sender: Any = None, task: Any = None, retval: Any = None, state: str = "", **_: Any
) -> None:
    """``task_postrun`` in the pool child: the run's result stored for the ids it ran for."""
    ids = getattr(task.request, STANDS_FOR_FIELD, None) if task is not None else None
    if not ids or state not in states.READY_STATES or task.ignore_result:
        return  # a retry: the final attempt writes them
    backend = task.backend
    if isinstance(backend, DisabledBackend):
        return
    for task_id in ids:
        try:
            backend.store_result(task_id, retval, state)
        except Exception:  # one id's failure must not hide the others
            logger.exception("could not store the result of %s for %s", task.request.id, task_id)


def install() -> None:
    signals.task_postrun.connect(write_stand_in_results, weak=False, dispatch_uid="baton-stand-ins")
