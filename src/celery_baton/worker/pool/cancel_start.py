"""A cancel (``baton.cancel``) judged where a prefork pool process takes a late job.

The gate call that granted a guarded request checked its id (``NotCancelled``), and
the main process hands it over at once; but a cancel that reaches the store while the
job stands between the hand-over and its process (the process stopped, swapped out,
starved on a loaded machine) would not stop it, and the body would start seconds after
its cancel. The promise is judged at the body's start.

So every guarded job carries the moment it was granted for (``HANDED_FIELD``), and a
pool process that reads it later than ``STALE_GRANT`` asks the store about a cancel
(after a stale rate grant's fresh token: ``worker/pool/at_start.py``), just before it
accepts the job. Cancelled, the job is accepted with :class:`CancelledBeforeStart` in
place of its body, and the main process revokes it as Celery revokes
(``worker/request.py``): REVOKED, its event, its message acknowledged, its leases given
back. A job on time pays nothing: the grant's own check is moments old.

On gevent and eventlet the greenlet that starts the body asks the same, after Celery's
accept and the rate's judgement (``worker/pool/in_process.py``): a greenlet reached late
(its accept waiting on a broker that does not answer) is the same late start. Not
judged: a plain job (no gate call, its request not ours to end), and the threads pool,
whose thread takes the job as it is handed over (nothing stands between).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from celery import current_app

from celery_baton.parts import parts_for
from celery_baton.worker.pool.rate_grant import STALE_GRANT

logger = logging.getLogger("celery_baton.worker")

#: ``(main pid, the moment (time.monotonic()) the job was granted for)``.
HANDED_FIELD = "baton_handed"


class CancelledBeforeStart(Exception):
    """Raised in place of a body whose call was cancelled while its job stood between
    the hand-over and its pool process; the main process revokes the request."""


def mark(request_dict: dict[str, Any], due: float) -> None:
    """Main process, as a guarded request goes to the pool."""
    request_dict[HANDED_FIELD] = (os.getpid(), due)


def cancelled(name: str, task_id: str, request_dict: dict[str, Any]) -> bool:
    """Whether the job of ``task_id``, read late by its pool process, was cancelled
    meanwhile (False when on time, or when the store does not answer: it runs)."""
    fields = request_dict.get(HANDED_FIELD)
    if not fields:
        return False
    try:
        _main_pid, due = fields
        late = time.monotonic() - due
        if late <= STALE_GRANT:
            return False
        if not parts_for(current_app.tasks[name].app).cancels.is_cancelled(task_id):
            return False
    except Exception:  # never lose the job: it runs, and the error is logged
        logger.exception("baton: %s[%s]: asking about a cancel failed", name, task_id)
        return False
    logger.info(
        "%s[%s] was cancelled while it waited %.2fs for its pool process: it does not start",
        name,
        task_id,
        late,
    )
    return True


def cancelled_body(task_id: str) -> Callable[..., Any]:
    """What the pool process runs in place of a cancelled job's body."""

    def body(*args: Any, **kwargs: Any) -> Any:
        raise CancelledBeforeStart(task_id)

    return body


def cancelled_trace(task_id: str) -> Callable[..., Any]:
    """What a greenlet runs in place of a cancelled job's trace (gevent, eventlet:
    ``worker/pool/in_process.py``): the failed trace Celery's ``trace_task_ret`` returns
    (``(1, ExceptionInfo, runtime)``), which the request's ``on_success`` hands to its
    ``on_failure``, where it is revoked as in prefork."""
    from billiard.einfo import ExceptionInfo

    def trace(*args: Any, **kwargs: Any) -> Any:
        try:
            raise CancelledBeforeStart(task_id)
        except CancelledBeforeStart:
            return 1, ExceptionInfo(), 0.0

    return trace
