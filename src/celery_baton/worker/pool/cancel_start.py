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
(its accept waiting on a broker that does not answer) is the same late start. The
threads pool's thread takes a guarded job as it is handed over (nothing stands between).

A plain job (no gate call) waits in the worker for a pool process when every process is
busy, after it was screened; a cancel noticed meanwhile (``share_cancels``: the ids the
worker was told of, in memory its processes share) is asked of the store where the job
starts, on every pool, and a cancelled one is ignored as Celery ignores a task
(``plain_cancelled_trace``). A guarded job whose cancel was noticed is asked too,
however early it is read.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from celery import current_app

from celery_baton.core.shared_cancels import SharedCancels
from celery_baton.parts import parts_for
from celery_baton.worker.pool.rate_grant import STALE_GRANT

logger = logging.getLogger("celery_baton.worker")

#: ``(main pid, the moment (time.monotonic()) the job was granted for)``.
HANDED_FIELD = "baton_handed"


class CancelledBeforeStart(Exception):
    """Raised in place of a body whose call was cancelled while its job stood between
    the hand-over and its pool process; the main process revokes the request."""


#: The ids this worker was told are cancelled (core/shared_cancels.py): made by the
#: main process before the pool forks (``share_cancels``).
_noticed: SharedCancels | None = None


def share_cancels() -> SharedCancels:
    """Worker's main process, before the pool starts: the table of noticed cancels its
    pool processes (forked from it) and its threads and greenlets read."""
    global _noticed
    if _noticed is None:
        _noticed = SharedCancels()
    return _noticed


def noticed(task_id: str) -> bool:
    """Whether this worker was told ``task_id`` is cancelled (a hint, in memory)."""
    return _noticed is not None and _noticed.has(task_id)


def _asked(name: str, task_id: str) -> bool:
    """The store's word on a cancel of ``task_id``; False when it does not answer (the
    job runs, and the error is logged: never lose it)."""
    try:
        return bool(parts_for(current_app.tasks[name].app).cancels.is_cancelled(task_id))
    except Exception:
        logger.exception("baton: %s[%s]: asking about a cancel failed", name, task_id)
        return False


def plain_cancelled(name: str, task_id: str) -> bool:
    """A plain job (no gate call) about to start: cancelled since its worker screened it?
    Asked of the store only when this worker was told of a cancel of its id; False when
    the store does not answer (it runs, as a call screened unchecked does)."""
    if not noticed(task_id) or not _asked(name, task_id):
        return False
    logger.info(
        "%s[%s] was cancelled while it waited for its pool: it does not start "
        "(its result is REVOKED)",
        name,
        task_id,
    )
    return True


def unless_cancelled(name: str, task_id: str, target: Callable[..., Any]) -> Callable[..., Any]:
    """Where a job is about to start: its trace ``target``, or for a job cancelled since
    its worker screened it (:func:`plain_cancelled`) the ignored trace in its place."""
    if plain_cancelled(name, task_id):
        return plain_cancelled_trace(task_id)
    return target


def plain_cancelled_trace(task_id: str) -> Callable[..., Any]:
    """What runs in place of a cancelled plain job's trace, on every pool (in a prefork
    pool process, on an executor thread, a greenlet, or solo's loop): the ignored trace
    Celery's ``trace_task_ret`` returns (Celery's ``Ignore``), which the request's
    ``on_success`` hands to ``on_failure``: acknowledged, nothing stored over the
    ``REVOKED`` its cancel wrote, no error callback run."""
    from billiard.einfo import ExceptionInfo
    from celery.exceptions import Ignore

    def trace(*args: Any, **kwargs: Any) -> Any:
        try:
            raise Ignore(f"cancelled: {task_id}")
        except Ignore:
            return 1, ExceptionInfo(internal=True), 0.0

    return trace


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
    except (TypeError, ValueError):  # not what mark() wrote: never guess, it runs
        return False
    if late <= STALE_GRANT and not noticed(task_id):
        return False
    if not _asked(name, task_id):
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
