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
(its accept waiting on a broker that does not answer) is the same late start; so do the
threads pool's thread (late behind a starved process, or after a stale rate grant's
fresh token) and solo's loop (a worker that stood still at the hand-over).

A plain job (no gate call) waits in the worker for a pool process when every process is
busy, after it was screened; a cancel noticed meanwhile (``share_cancels``: the ids the
worker was told of, in memory its processes share) is judged where the job starts, on
every pool: an id noticed by id is asked of the store; an id the main process matched
to a cancel by key (``worker/cancelling.py``, when it learned of the cancel) is trusted
while that cancel lives. While the worker has not heard every notice for
``UNHEARD_BOUND`` (it stood still, or its notice connection is being made again), a job
asks the store where it starts, by id and by its task's key cancels. A cancelled plain
job's trace is replaced by one that raises :class:`CancelledAtStart` (Celery's
``Ignore``); the main process revokes its request as Celery revokes (``REVOKED``, the
``task-revoked`` event, acknowledged: ``worker/cancelling.py``). A guarded job whose
cancel was noticed is judged too, however early it is read.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from celery import current_app
from celery.exceptions import Ignore

from celery_baton.core.policy.headers import PUBLISH_HEADER, stamp_time
from celery_baton.core.shared_cancels import SharedCancels
from celery_baton.parts import parts_for
from celery_baton.worker.pool.rate_grant import STALE_GRANT
from celery_baton.worker.transport.queued import decode_body

logger = logging.getLogger("celery_baton.worker")

#: ``(main pid, the moment (time.monotonic()) the job was granted for)``.
HANDED_FIELD = "baton_handed"


#: Seconds a worker may go without having heard every cancel notice (its notice
#: listener polls every ``core.notices.POLL``) before a job starting there asks the
#: store itself: the worker stood still, or its notice connection is being made again
#: after a loss (a notice sent meanwhile never comes).
UNHEARD_BOUND = 1.0
#: Seconds a process does not ask the store again for that reason after an ask failed
#: (the store is down: no cancel can be made meanwhile either).
ASK_AGAIN_AFTER = 2.0
_ask_failed_at = -ASK_AGAIN_AFTER

#: Why a job is refused at its start: its id noticed by id (confirmed in the store), or
#: matched by the main process to a live cancel by key.
BY_ID = "cancelled by id"
BY_KEY = "cancelled by key"


class CancelledBeforeStart(Exception):
    """Raised in place of a body whose call was cancelled while its job stood between
    the hand-over and its pool process; the main process revokes the request."""

    def __init__(self, task_id: str, why: str = BY_ID) -> None:
        super().__init__(task_id, why)
        self.why = why


class CancelledAtStart(Ignore):  # type: ignore[misc]
    """What a plain job cancelled while it waited for its pool raises in place of its
    trace. Celery ignores it (acknowledged, nothing stored); a request that the worker
    found cancelled while it waited (``worker/cancelling.py``) is revoked instead."""

    def __init__(self, task_id: str, why: str = BY_ID) -> None:
        super().__init__(task_id, why)
        self.why = why


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


def _asked(name: str, task_id: str, trace_args: Sequence[Any] | None) -> str | None:
    """The store's word on a cancel of ``task_id``: by id, then (``trace_args``: the
    job's, whose call's arguments are read) by a key of its task that covers the call,
    which the worker may not have matched yet (it stood still, or has not read the
    notice). None when it does not answer (the job runs, and the error is logged: never
    lose it)."""
    try:
        task = current_app.tasks[name]
        cancels = parts_for(task.app).cancels
        if cancels.is_cancelled(task_id):
            return BY_ID
        call = _call_of(trace_args, task.app) if trace_args is not None else None
        if call is None:
            return None
        args, kwargs, request_dict = call
        sent_ms = stamp_time(request_dict.get(PUBLISH_HEADER))
        covering = cancels.key_cancel_covering(name, task.run, args, kwargs, sent_ms)
        return None if covering is None else BY_KEY
    except Exception:
        global _ask_failed_at
        _ask_failed_at = time.monotonic()
        logger.exception("baton: %s[%s]: asking about a cancel failed", name, task_id)
        return None


def _call_of(
    trace_args: Sequence[Any], app: Any
) -> tuple[Sequence[Any], Mapping[str, Any], Mapping[str, Any]] | None:
    """The positional and keyword arguments and the request of a job's call, from
    Celery's ``trace_task_ret`` arguments ``(name, id, request, body, content type,
    encoding)`` (the body decoded as the trace decodes it); None if not that shape."""
    try:
        request_dict, body, content_type, content_encoding = trace_args[2:6]
    except (TypeError, ValueError):
        return None
    body = decode_body(app, body, content_type, content_encoding)
    args, kwargs = body[0], body[1]
    return args or (), kwargs or {}, request_dict


def _why(
    name: str, task_id: str, *, ask: bool, trace_args: Sequence[Any] | None = None
) -> str | None:
    """Why the job of ``task_id`` is cancelled, or None: matched by key in the main
    process (trusted while that cancel lives), else asked of the store (by id, and by
    key with ``trace_args``) when this worker noticed the id, or when ``ask``."""
    until = _noticed.find(task_id) if _noticed is not None else None
    if until is None and not ask:
        return None  # nobody cancelled it: the common case, one lookup in memory
    if until is not None and until > time.monotonic():
        return BY_KEY
    return _asked(name, task_id, trace_args)


def _unheard() -> bool:
    """Whether this worker has not heard every cancel notice for longer than
    ``UNHEARD_BOUND`` (and the store did not fail an ask moments ago)."""
    if _noticed is None:
        return False
    now = time.monotonic()
    return _noticed.unheard_for(now) > UNHEARD_BOUND and now - _ask_failed_at > ASK_AGAIN_AFTER


def plain_cancelled(name: str, task_id: str, trace_args: Sequence[Any] | None = None) -> str | None:
    """A plain job (no gate call) about to start: why it was cancelled since its worker
    screened it, or None. A job whose id this worker noticed (by id, or matched by key)
    is judged; while the worker has not heard its notices lately, every plain job asks
    the store (by id, and with ``trace_args`` by its task's key cancels). None when the
    store does not answer (it runs, as a call screened unchecked does)."""
    why = _why(name, task_id, ask=_unheard(), trace_args=trace_args)
    if why is not None:
        logger.info(
            "%s[%s] was cancelled while it waited for its pool: it does not start (%s; "
            "its result is REVOKED)",
            name,
            task_id,
            why,
        )
    return why


def unless_cancelled(
    name: str, task_id: str, target: Callable[..., Any], trace_args: Sequence[Any] | None
) -> Callable[..., Any]:
    """Where a job is about to start: its trace ``target``, or for a job cancelled since
    its worker screened it (:func:`plain_cancelled`; ``trace_args``: the job's) the
    ignored trace in its place."""
    why = plain_cancelled(name, task_id, trace_args)
    if why is not None:
        return plain_cancelled_trace(task_id, why)
    return target


def plain_cancelled_trace(task_id: str, why: str = BY_ID) -> Callable[..., Any]:
    """What runs in place of a cancelled plain job's trace, on every pool (in a prefork
    pool process, on an executor thread, a greenlet, or solo's loop): the ignored trace
    Celery's ``trace_task_ret`` returns for ``Ignore`` (here :class:`CancelledAtStart`),
    which the request's ``on_success`` hands to ``on_failure``: there the worker revokes
    it (``worker/cancelling.py``: REVOKED, the ``task-revoked`` event, acknowledged, no
    error callback run); a request it did not find is only acknowledged, as Celery does
    for ``Ignore``."""
    from billiard.einfo import ExceptionInfo

    def trace(*args: Any, **kwargs: Any) -> Any:
        try:
            raise CancelledAtStart(task_id, why)
        except CancelledAtStart:
            return 1, ExceptionInfo(internal=True), 0.0

    return trace


def mark(request_dict: dict[str, Any], due: float) -> None:
    """Main process, as a guarded request goes to the pool."""
    request_dict[HANDED_FIELD] = (os.getpid(), due)


def cancelled(
    name: str, task_id: str, request_dict: dict[str, Any], trace_args: Sequence[Any]
) -> str | None:
    """Why the job of ``task_id``, read late by its pool process (or while its worker
    has not heard its notices lately), was cancelled meanwhile, or None (on time and not
    noticed, or the store does not answer: it runs).
    ``trace_args``: the job's (a late job is asked about its keys too)."""
    fields = request_dict.get(HANDED_FIELD)
    if not fields:
        return None
    try:
        _main_pid, due = fields
        late = time.monotonic() - due
    except (TypeError, ValueError):  # not what mark() wrote: never guess, it runs
        return None
    why = _why(name, task_id, ask=late > STALE_GRANT or _unheard(), trace_args=trace_args)
    if why is None:
        return None
    logger.info(
        "%s[%s] was cancelled while it waited %.2fs for its pool process: it does not start (%s)",
        name,
        task_id,
        late,
        why,
    )
    return why


def cancelled_body(task_id: str, why: str = BY_ID) -> Callable[..., Any]:
    """What the pool process runs in place of a cancelled job's body."""

    def body(*args: Any, **kwargs: Any) -> Any:
        raise CancelledBeforeStart(task_id, why)

    return body


def cancelled_trace(task_id: str, why: str = BY_ID) -> Callable[..., Any]:
    """What a greenlet runs in place of a cancelled job's trace (gevent, eventlet:
    ``worker/pool/in_process.py``): the failed trace Celery's ``trace_task_ret`` returns
    (``(1, ExceptionInfo, runtime)``), which the request's ``on_success`` hands to its
    ``on_failure``, where it is revoked as in prefork."""
    from billiard.einfo import ExceptionInfo

    def trace(*args: Any, **kwargs: Any) -> Any:
        try:
            raise CancelledBeforeStart(task_id, why)
        except CancelledBeforeStart:
            return 1, ExceptionInfo(), 0.0

    return trace
