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
from celery.exceptions import TaskRevokedError, TimeLimitExceeded, WorkerLostError

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


#: Set on a request whose lost run's ids were written (prefork's hard time limit ends
#: a job twice: its failure, then its timeout).
_WRITTEN_ATTR = "_baton_stood_in"


def after_lost_run(request: Any, exc: BaseException | None, *, final: bool) -> None:
    """Main process: the pool child running this request died (``WorkerLostError``) or
    was killed at its hard time limit (a gevent greenlet unwound by it), or the run was
    revoked (before it started, or terminated), so no ``task_postrun`` wrote the ids it
    stood for. When the message will not come back (``final``; else its next delivery
    is told the same ids), write what the run's own id now holds to each of them: the
    failure or revoke Celery recorded, or a success stored before the child was lost.
    Once per request."""
    ids = request.request_dict.get(STANDS_FOR_FIELD)
    if not ids or not final or request.__dict__.get(_WRITTEN_ATTR):
        return
    task = request.task
    if not isinstance(exc, WorkerLostError | TimeLimitExceeded | TaskRevokedError):
        return
    if task.ignore_result:
        return
    backend = task.backend
    if isinstance(backend, DisabledBackend):
        return
    request.__dict__[_WRITTEN_ATTR] = True
    try:
        meta = backend.get_task_meta(request.id)
        state, result = meta.get("status"), meta.get("result")
        if state not in states.READY_STATES:
            state, result = states.FAILURE, exc
        elif state in states.EXCEPTION_STATES:
            result = backend.exception_to_python(result)
    except Exception:
        logger.exception("could not read the result of %s", request.id)
        state, result = states.FAILURE, exc
    for task_id in ids:
        try:
            backend.store_result(task_id, result, state)
        except Exception:
            logger.exception("could not store the result of %s for %s", request.id, task_id)


def install() -> None:
    signals.task_postrun.connect(write_stand_in_results, weak=False, dispatch_uid="baton-stand-ins")
