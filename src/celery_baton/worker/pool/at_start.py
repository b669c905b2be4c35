"""What is judged again where a task body starts, after the main process handed it over.

The main process judges a request when it hands it to the pool; what happens after the
hand-over it cannot see. So a request carries what must hold at its start, and the
process, thread or greenlet that starts the body judges it just before:

* a rate grant read too late takes a fresh token (``worker/pool/rate_grant.py``);
* a throttle window opened too long ago counts from the start (``throttle_start.py``);
* a prefork job read late is asked about a cancel, last (``cancel_start.py``);
* a plain job whose id this worker was told is cancelled (by id, or matched by key) is
  judged (every pool).

``judge_before_accept`` is called by a prefork pool process on the job it just read
from its pipe (``worker/pool/prefork.py``); ``judge`` by the thread or greenlet that
runs the body on the threads and gevent pools (``worker/pool/in_process.py``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from celery import current_app

from celery_baton.parts import parts_for
from celery_baton.worker.pool import cancel_start, rate_grant, throttle_start

logger = logging.getLogger("celery_baton.worker")

#: Fields of a request whose presence asks for a judgement; a request without any of
#: them (most) costs a dict lookup each.
_FIELDS = (rate_grant.RATE_GRANT_FIELD, throttle_start.THROTTLE_FIELD)
_PREFORK_FIELDS = (*_FIELDS, cancel_start.HANDED_FIELD)


def task_request(args: Sequence[Any]) -> tuple[str, str, dict[str, Any]] | None:
    """The task name, id and request dict of Celery's ``trace_task_ret`` ``args``
    (``(task name, task id, request dict, body, content type, encoding)``)."""
    try:
        name, task_id, request_dict = args[0], args[1], args[2]
    except (TypeError, IndexError, KeyError):
        return None
    if not isinstance(request_dict, dict) or not isinstance(name, str):
        return None
    return name, task_id, request_dict


def judge(name: str, task_id: str, request_dict: dict[str, Any]) -> None:
    """Judge a request whose body is about to start (see the module docstring)."""
    if not any(field in request_dict for field in _FIELDS):
        return
    rate_grant.judge(name, task_id, request_dict)  # a fresh token first: it may wait
    if throttle_start.THROTTLE_FIELD in request_dict:
        try:
            store = parts_for(current_app.tasks[name].app).store
            throttle_start.judge(store, name, task_id, request_dict)
        except Exception:  # never lose the job: it runs, and the error is logged
            logger.exception("baton: %s[%s]: judging its throttle window failed", name, task_id)


def judged_in_pool(request_dict: dict[str, Any]) -> bool:
    """Whether a prefork pool process judges this request before accepting it."""
    return any(field in request_dict for field in _PREFORK_FIELDS)


def judge_before_accept(job: Any) -> Any:
    """In a prefork pool process, a job just read from its pipe, before it is accepted:
    the job to accept (``job``, or for a call cancelled meanwhile the same job with
    ``cancel_start.CancelledBeforeStart`` in place of its body).

    ``job`` is billiard's ``(TASK, (job, i, fun, args, kwargs))``. A job that the main
    process runs itself (a pool without processes) was judged there."""
    try:
        kind, (job_id, i, _fun, args, kwargs) = job
    except (TypeError, ValueError):
        return job  # not a Celery task's job: nothing of ours in it
    found = task_request(args)
    if found is None:
        return job
    name, task_id, request_dict = found
    if not judged_in_pool(request_dict):
        # A plain job: cancelled since its worker screened it (told so, in memory)?
        fun = cancel_start.unless_cancelled(name, task_id, _fun, args)
        return job if fun is _fun else (kind, (job_id, i, fun, args, kwargs))
    fields = (
        request_dict.get(rate_grant.RATE_GRANT_FIELD)
        or request_dict.get(throttle_start.THROTTLE_FIELD)
        or request_dict.get(cancel_start.HANDED_FIELD)
    )
    if fields and fields[0] == os.getpid():
        return job
    judge(name, task_id, request_dict)
    why = cancel_start.cancelled(name, task_id, request_dict, args)
    if why is not None:
        return kind, (job_id, i, cancel_start.cancelled_body(task_id, why), args, kwargs)
    return job
