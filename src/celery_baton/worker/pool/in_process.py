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
            target = cancel_start.unless_cancelled(found[0], found[1], target, args)
        return run(target, args, kwargs, callback, accept_callback, *given, *rest, **options)
    accept_callback(getpid() if getpid is not None else os.getpid(), time.monotonic())
    at_start.judge(*found)
    why = cancel_start.cancelled(*found, args)  # last: the rate's wait may have been long
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


def _checked_at_start(
    target: Callable[..., Any], found: tuple[str, str, dict[str, Any]]
) -> Callable[..., Any]:
    """``target`` (a job's trace), asking just before it runs whether the job was
    cancelled since its worker judged it: a guarded job read late (the worker or its
    thread stood still, or a stale rate grant's fresh token was waited for) asks the
    store, as a greenlet does; any job whose cancel this worker noticed meanwhile is
    refused (``cancel_start.unless_cancelled``)."""
    name, task_id, request_dict = found
    if cancel_start.HANDED_FIELD not in request_dict:  # a plain job: noticed, or not

        def checked_plain(*args: Any, **kwargs: Any) -> Any:
            return cancel_start.unless_cancelled(name, task_id, target, args)(*args, **kwargs)

        return checked_plain

    def checked(*args: Any, **kwargs: Any) -> Any:
        # A guarded job: ``cancelled`` looks up a noticed cancel too, once.
        why = cancel_start.cancelled(name, task_id, request_dict, args)
        trace = target if why is None else cancel_start.cancelled_trace(task_id, why)
        return trace(*args, **kwargs)

    return checked


def install_threads_and_solo(task_pool: Any) -> None:
    """Make Celery's threads or solo ``task_pool`` judge each job where it starts (on
    the executor's thread; solo: on the loop, as it is handed over, which a worker that
    stood still reaches late too): a rate grant or throttle window first, in the accept
    callback (nothing is acknowledged while it waits), then a cancel, just before the
    trace."""
    apply = task_pool.on_apply

    def on_apply(target: Any, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        found = at_start.task_request(args) if args else None
        if found is not None:
            accept = options.get("accept_callback")
            if accept is not None and any(f in found[2] for f in _FIELDS):
                options["accept_callback"] = _judged_first(found, accept)
            target = _checked_at_start(target, found)
        return apply(target, args, kwargs, **options)

    task_pool.on_apply = on_apply
