"""Celery's gevent, eventlet and threads pools: a rate grant and a throttle window
judged where the body starts (issue 34 (a)).

On these pools the body runs on a greenlet or an executor thread of the main process.
The main process judged the request when it handed it over (``worker/starting.py``);
what happens between the hand-over and the body it cannot see:

* gevent and eventlet (said of gevent below, alike on eventlet): the greenlet's first
  act is Celery's accept (``Request.on_accepted``), and on a worker without an event
  loop that acknowledges the message there and then (``Consumer.call_soon_ack``): a
  broker call. While the broker does not answer (slow, failing over, paused) the
  greenlet waits in it, and the worker, whose own greenlet goes on, grants the next
  request to the next free greenlet, which waits too; when the broker answered, their
  bodies started at once, and together with the grants that follow (three starts in 36
  ms at 2/s). A greenlet that the hub reaches late (another greenlet computing without
  yielding) starts late the same way.
* both: before Celery 5.7 a lost broker connection empties ``reserved_requests``,
  running requests included; counted by those, the pool looked free while its threads
  (greenlets) ran, and a grant waited behind them (the pool slots now count running
  requests too: ``worker/pool_slots.py``).

So the greenlet accepts its job, then judges it (``worker/pool/at_start.py``: a stale
rate grant takes a fresh token, a late throttle run moves its window), then runs it:
just before the body, and before Celery's hard time limit starts (gevent's ``Timeout``
around the job; gevent has no soft limit), so that no limit cuts the wait. Its message
is acknowledged before the wait, as Celery acknowledges it before the body. On threads
the event loop acknowledges the message, so the thread judges the job first, then
accepts it (no time limits there): nothing is acknowledged while it waits. Solo runs the
body as it is handed over: the main process's judgement is the last one.

The private names used here are checked by ``internals.gevent_pool``,
``internals.eventlet_pool`` and ``internals.threads_pool``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from celery_baton.worker.pool import at_start, cancel_start, rate_grant, throttle_start

_FIELDS = (rate_grant.RATE_GRANT_FIELD, throttle_start.THROTTLE_FIELD)
#: What a greenlet judges: the above, and a cancel of a guarded job reached late.
_GREEN_FIELDS = (*_FIELDS, cancel_start.HANDED_FIELD)


def _accept_judge_run(
    run: Callable[..., Any],
    target: Any,
    args: Any,
    kwargs: Any,
    callback: Any,
    accept_callback: Callable[[Any, float], Any] | None,
    getpid: Callable[[], Any] | None = None,
    *rest: Any,
    **options: Any,
) -> Any:
    """The greenlet's job: Celery's accept, the judgement, then Celery's own ``run``
    (``apply_timeout`` or ``apply_target``), which would have accepted it first.

    Celery 5.5 and later pass ``getpid``; before, nothing (the process's pid is the
    accept's), so it is passed on only when given."""
    given = () if getpid is None else (getpid,)
    found = at_start.task_request(args)
    if found is None or accept_callback is None or not any(f in found[2] for f in _GREEN_FIELDS):
        if found is not None:
            target = cancel_start.unless_cancelled(found[0], found[1], target)
        return run(target, args, kwargs, callback, accept_callback, *given, *rest, **options)
    accept_callback(getpid() if getpid is not None else os.getpid(), time.monotonic())
    at_start.judge(*found)
    why = cancel_start.cancelled(*found)  # last: the rate's wait may have been long
    if why is not None:
        target = cancel_start.cancelled_trace(found[1], why)
    return run(target, args, kwargs, callback, None, *given, *rest, **options)


def install(task_pool: Any) -> None:
    """Make Celery's gevent or eventlet ``task_pool`` (not started yet) spawn each job
    judged."""
    start = task_pool.on_start

    def on_start() -> None:
        start()
        spawn = task_pool._quick_put

        def quick_put(run: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            return spawn(_accept_judge_run, run, *args, **kwargs)

        task_pool._quick_put = quick_put

    task_pool.on_start = on_start


def _judged_first(
    found: tuple[str, str, dict[str, Any]], accept: Callable[[Any, float], Any]
) -> Callable[[Any, float], Any]:
    """Celery's accept callback, called on the executor thread before the body, judging
    the request first: its message is not acknowledged while it waits."""

    def judge_then_accept(pid: Any, _time_accepted: float) -> Any:
        at_start.judge(*found)
        return accept(pid, time.monotonic())

    return judge_then_accept


def _cancel_checked(target: Callable[..., Any], name: str, task_id: str) -> Callable[..., Any]:
    """``target`` (a job's trace), asking just before it runs whether the job was
    cancelled since its worker screened it (``cancel_start.unless_cancelled``)."""

    def checked(*args: Any, **kwargs: Any) -> Any:
        return cancel_start.unless_cancelled(name, task_id, target)(*args, **kwargs)

    return checked


def install_threads(task_pool: Any) -> None:
    """Make Celery's threads ``task_pool`` judge each job on its thread, first."""
    apply = task_pool.on_apply

    def on_apply(target: Any, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        accept = options.get("accept_callback")
        found = at_start.task_request(args) if args else None
        if found is not None and accept is not None and any(f in found[2] for f in _FIELDS):
            options["accept_callback"] = _judged_first(found, accept)
        elif found is not None:  # a job waiting in the executor's queue may be cancelled
            target = _cancel_checked(target, found[0], found[1])
        return apply(target, args, kwargs, **options)

    task_pool.on_apply = on_apply


def install_solo(task_pool: Any) -> None:
    """Make Celery's solo ``task_pool`` ask about a plain job's cancel as it runs it (on
    the loop, which may have read the job before the notice of its cancel)."""
    apply = task_pool.on_apply

    def on_apply(target: Any, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        found = at_start.task_request(args) if args else None
        if found is not None:
            target = cancel_start.unless_cancelled(found[0], found[1], target)
        return apply(target, args, kwargs, **options)

    task_pool.on_apply = on_apply
