"""Superseding deliveries on the worker side: the publish order a delivery asks with,
and the terminate request a ``"replace"`` delivery sends for the run it replaces.

Which delivery is newest is decided by the gate (gate.lua ``"S"``, from the order each
publish was stamped with: ``supersede.py``); what to do about it by the verdict. This
module only carries the order and sends the revoke.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from celery import states
from celery.backends.base import DisabledBackend

from celery_baton.core.conditions import PublishOrder
from celery_baton.core.policy.headers import ORDER_HEADER
from celery_baton.core.policy.model import RunPlan
from celery_baton.errors import TaskSuperseded
from celery_baton.worker.verdict import REVOKE_AGAIN

logger = logging.getLogger("celery_baton.worker")

#: The signal a replaced run is terminated with. SIGKILL: a run that traps SIGTERM (or
#: is stuck in C code) would otherwise go on beside its replacement; the holder's worker
#: releases the key only once that process is gone (``Releasing.finish_when_ended``).
REPLACE_SIGNAL = "SIGKILL"


def order_of(request: Any) -> int | None:
    """A superseding publish's order, from its header (None: absent or unreadable)."""
    value = request.request_dict.get(ORDER_HEADER)
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def keep_order(request: Any, plan: RunPlan, order: int) -> None:
    """A message published without an order was given one by the gate: keep it for every
    later ask of this delivery (and for a plan rebuilt from the request)."""
    request.request_dict[ORDER_HEADER] = order
    plan.conditions = [
        replace(c, order=order) if isinstance(c, PublishOrder) and c.order is None else c
        for c in plan.conditions
    ]


#: The revoke broadcast's argument naming the replacing task and the message of the
#: ``TaskSuperseded`` (Celery's revoke handler takes and ignores unknown arguments).
REPLACED_BY_ARG = "baton_replaced_by"


def keeps_results(backend: Any) -> bool:
    """Whether the app has a result backend: without one (Celery's ``DisabledBackend``)
    there is nothing to record a replaced run in, and nothing to say about it."""
    return not isinstance(backend, DisabledBackend)


def superseded_error(name: str, holder: str, replacing: str) -> TaskSuperseded:
    return TaskSuperseded(
        f"{name}[{holder}] was replaced by a newer publish, task {replacing}; it was terminated",
        replacing,
    )


def record_superseded(request: Any, holder: str) -> None:
    """The run about to be stopped resolves to ``TaskSuperseded`` naming ``request``:
    written BEFORE the revoke, so that it is the first ready state a waiting caller
    sees, and Celery's own ``TaskRevokedError`` is never written over it (a worker's
    revoke leaves a ready state alone; the holder's worker keeps it: ``superseded_by``).
    A run that already has a result (it just ended) keeps it."""
    task = request.task
    if task.ignore_result or not keeps_results(task.backend):
        return
    try:
        if task.backend.get_state(holder) in states.READY_STATES:
            return
        task.backend.store_result(
            holder, superseded_error(request.name, holder, request.id), states.REVOKED
        )
    except Exception:  # the result backend is optional; the revoke goes out regardless
        logger.exception("baton: could not record %s as superseded", holder)


def keep_superseded_on_revoke(panel: dict[str, Any]) -> None:
    """Wrap the worker's ``revoke`` control handler (``panel``: Celery's
    ``Panel.data``) so that a replaced run's ``TaskSuperseded`` outlives it.

    Celery before 5.7 marks every id of a revoke ``REVOKED`` in the result backend, in
    every worker the broadcast reaches, whatever the id's state (5.7 leaves ready and
    running ids alone): it writes ``TaskRevokedError('revoked')`` over the record above.
    The broadcast of a replacement names the replacing task (``REPLACED_BY_ARG``), so
    each worker writes the record back after its own handler ran: whatever the order
    of the workers, the last write is a record. A caller already waiting saw the
    record first (it was written before the broadcast)."""
    handler = panel.get("revoke")
    if handler is None or getattr(handler, "_baton_keeps_superseded", False):
        return

    def revoke(state: Any, task_id: Any, *args: Any, **kwargs: Any) -> Any:
        replaced_by = kwargs.get(REPLACED_BY_ARG)
        try:
            return handler(state, task_id, *args, **kwargs)
        finally:
            if isinstance(replaced_by, list) and len(replaced_by) == 3:
                _rewrite_superseded(state.app.backend, *map(str, replaced_by))

    revoke._baton_keeps_superseded = True  # type: ignore[attr-defined]
    revoke.__doc__ = handler.__doc__
    panel["revoke"] = revoke


def _rewrite_superseded(backend: Any, name: str, holder: str, replacing: str) -> None:
    if not keeps_results(backend):
        return
    try:
        meta = backend.get_task_meta(holder, cache=False)
        if meta.get("status") != states.REVOKED or isinstance(meta.get("result"), TaskSuperseded):
            return  # a result of its own, or the record still there
        backend.store_result(holder, superseded_error(name, holder, replacing), states.REVOKED)
    except Exception:  # the result backend is optional
        logger.exception("baton: could not record %s as superseded", holder)


def superseded_by(request: Any) -> TaskSuperseded | None:
    """The ``TaskSuperseded`` the revoked ``request`` already resolved to (its replacing
    worker wrote it), naming the task that replaced it: then Celery must not overwrite it
    with its own ``TaskRevokedError``. A read on a rare path (a run revoked while admitted)."""
    try:
        meta = request.task.backend.get_task_meta(request.id)
    except Exception:
        return None
    result = meta.get("result")
    if meta.get("status") == states.REVOKED and isinstance(result, TaskSuperseded):
        return result
    return None


class Replacing:
    """Sends the terminate requests of ``"replace"`` deliveries, at most one per holder
    every ``REVOKE_AGAIN`` seconds (the holder's release wakes the waiting delivery; a
    revoke sent again only covers one lost on the way)."""

    def __init__(self) -> None:
        self._sent_at: dict[str, float] = {}
        #: Tells a revoke's arguments on the store's notice channel, for workers that
        #: take no remote control (worker/told_revokes.py); None: the broadcast only.
        self.tell: Callable[[dict[str, Any]], None] | None = None

    def terminate(self, request: Any, holder: str, plan: RunPlan, now: float) -> None:
        if now - self._sent_at.get(holder, -1e9) < REVOKE_AGAIN * 0.9:
            return
        if len(self._sent_at) > 1000:
            self._sent_at = {h: t for h, t in self._sent_at.items() if now - t < 60}
        self._sent_at[holder] = now
        label = plan.labels.get(plan.exclusive_key or "", "") or "(task)"
        logger.info(
            "%s[%s] replaces task %s (exclusive key %s): terminating it",
            request.name,
            request.id,
            holder,
            label,
        )
        record_superseded(request, holder)
        try:
            # A broadcast: it reaches the holder's worker wherever it runs (this one too),
            # and marks the id revoked everywhere, so a redelivered copy is discarded.
            # It names the replacing task, for Celery's that overwrite the record
            # (keep_superseded_on_revoke); Control.revoke cannot carry it.
            arguments = {
                "task_id": [holder],
                "terminate": True,
                "signal": REPLACE_SIGNAL,
                REPLACED_BY_ARG: [request.name, holder, request.id],
            }
            request.task.app.control.broadcast("revoke", arguments=arguments)
            if self.tell is not None:
                self.tell(arguments)
        except Exception:  # sent again at the next ask; never lose the waiting request
            logger.exception("baton: could not send the revoke of %s; trying again", holder)
            self._sent_at.pop(holder, None)
