"""What happens to a delivery that leaves admission without running, and Celery's own
rate limits as admission reads them. Celery's side of each outcome, in one place:
the state a waiting caller sees, the signal, the log line, the ack or the reject.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import states
from celery.utils.time import rate as parse_celery_rate
from celery.worker import state as worker_state

from celery_baton import internals, metrics, signals
from celery_baton.errors import BatonError, TaskDeduplicated, TaskSkipped, TaskSuperseded
from celery_baton.worker.verdict import Reason, Skip

logger = logging.getLogger("celery_baton.worker")


def skip(request: Any, skip: Skip) -> None:
    """Acked, not run: logged, signalled, and a clear final state for an exclusive
    duplicate (no errbacks: the work is being done by the holder)."""
    metrics.skips.labels(request.name, skip.reason.value).inc()
    logger.warning("%s[%s] skipped: %s", request.name, request.id, skip.message)
    signals.task_skipped.send(
        sender=request.task,
        request=request,
        key=skip.key,
        holder=skip.holder,
        reason=skip.reason.value,
    )
    task = request.task
    # A coalesced one gets no state here: the run that stands for it writes its outcome
    # to this id too (worker/pool/stand_ins.py).
    failed = (Reason.EXCLUSIVE, Reason.THROTTLED, Reason.OUT_OF_ORDER)
    if skip.reason in failed and not task.ignore_result:
        task.backend.mark_as_failure(
            request.id,
            TaskSkipped(skip.message, skip.key, skip.holder),
            request=internals.request_context(request),
            store_result=True,
            call_errbacks=False,
        )
    if skip.reason is Reason.DUPLICATE:
        # As a duplicate publish's pre-assigned id is told (publish.py): a caller waiting
        # on this id learns which task runs instead.
        signals.task_deduplicated.send(
            sender=request.name,
            name=request.name,
            task_id=request.id,
            existing_id=skip.holder,
            key=skip.key,
        )
        if not task.ignore_result:
            task.backend.mark_as_failure(
                request.id,
                TaskDeduplicated(skip.message, skip.holder),
                request=internals.request_context(request),
                store_result=True,
                call_errbacks=False,
            )
    if skip.reason is Reason.SUPERSEDED and not task.ignore_result:
        # REVOKED, naming the replacing task: a caller waiting on this id is told at once.
        task.backend.store_result(
            request.id,
            TaskSuperseded(skip.message, skip.holder),
            states.REVOKED,
            request=internals.request_context(request),
        )
    worker_state.task_ready(request)
    request.acknowledge()


def refuse(request: Any, exc: BatonError) -> None:
    """A request whose key cannot be built: fail it loudly; never run it unguarded."""
    logger.error("%s[%s] refused: %s", request.name, request.id, exc)
    signals.task_skipped.send(
        sender=request.task, request=request, key="", holder="", reason="invalid-key"
    )
    request.task.backend.mark_as_failure(
        request.id, exc, request=internals.request_context(request), store_result=True
    )
    worker_state.task_ready(request)
    request.acknowledge()


def hand_back(request: Any, why: str, *, one_of_many: bool = False) -> None:
    """Back to the broker unchanged (same id, headers and retry count; never task.retry).

    ``one_of_many``: one of many handed back together, in the order they should come
    back. Logged at DEBUG (the caller says how many, once), and rejected now: Celery
    queues each reject on the hub's ``call_soon``, whose callbacks run in no set order,
    and the broker would take them back in that order (a backlog of 151 came back three
    ways interleaved, a call 135 places ahead of its publish order)."""
    metrics.handed_back.labels(request.name).inc()
    logger.log(
        logging.DEBUG if one_of_many else logging.WARNING,
        "%s[%s] handed back to the broker: %s",
        request.name,
        request.id,
        why,
    )
    signals.task_handed_back.send(sender=request.task, request=request, reason=why)
    worker_state.task_ready(request)
    if one_of_many:
        # Celery's own reject callable (``Message.reject_log_error``), called at once.
        reject_now = getattr(getattr(request, "message", None), "reject_log_error", None)
        if callable(reject_now):
            request.on_reject = reject_now
    request.reject(requeue=True)


def throttle(request: Any, key: str, retry_after: float) -> None:
    """Held by a rate: counted and signalled (``task_throttled``)."""
    metrics.throttled.labels(request.name).inc()
    signals.task_throttled.send(
        sender=request.task, request=request, key=key, retry_after=retry_after
    )


class CeleryRates:
    """Celery's ``rate_limit`` of a task in starts per second (None: no limit), parsed
    the way Celery parses it, so a value Celery accepted is never refused here."""

    def __init__(self) -> None:
        self._cache: dict[Any, float | None] = {}

    def of(self, task: Any) -> float | None:
        value = task.rate_limit
        try:
            return self._cache[value]
        except KeyError:
            pass
        per_second: float | None = None
        try:
            per_second = float(parse_celery_rate(value)) or None
        except (ValueError, KeyError, TypeError):
            logger.error("rate_limit %r of %s is not a rate; not limiting it", value, task.name)
        if per_second is not None and not 0 < per_second < float("inf"):
            per_second = None
        self._cache[value] = per_second
        return per_second


def urgency(request: Any, *, lower_first: bool) -> float | None:
    """How urgent a request is by its message's own ``priority`` (higher: sooner), read
    the way its broker reads it: AMQP brokers run higher priorities first, kombu's Redis
    transport lower ones (``lower_first``). None when the message has no priority."""
    info = getattr(request, "delivery_info", None) or {}
    priority = info.get("priority")
    if priority is None:
        return None
    try:
        value = float(priority)
    except (TypeError, ValueError):
        return None
    return -value if lower_first else value
