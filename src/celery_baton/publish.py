"""The publish side: ``unique`` tasks are claimed when they are sent.

Every publish path ends in ``app.send_task``: ``delay``, ``apply_async``, sending by
name, canvas members (chain, group, chord) and beat. Wrapping it there covers all of
them at once. The claim uses the task id as owner, so a retry (same id) passes, and
a publish that fails gives its claim back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kombu.utils.uuid import uuid

from celery_baton import signals
from celery_baton.errors import TaskDeduplicated

if TYPE_CHECKING:
    from celery_baton.baton import Baton

logger = logging.getLogger("celery_baton.publish")


def guard_send_task(baton: Baton, send_task: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``app.send_task`` so that a unique task already queued is not queued again."""

    def send_unique_task(name: str, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        policy = baton.policy_for_name(name)
        if policy is None or policy.unique is None:
            return send_task(name, args, kwargs, **options)
        preassigned = options.get("task_id")
        task_id = preassigned or uuid()
        options["task_id"] = task_id
        key = policy.unique_key(baton.names, args or (), kwargs or {})
        ttl = policy.unique_ttl
        expires = options.get("expires")
        if isinstance(expires, int | float) and 0 < expires < ttl:
            ttl = float(expires)
        holder = baton.claim_unique(key, task_id, ttl)
        if holder:
            logger.info(
                "%s not queued: an earlier one with the same unique key is queued or running as %s",
                name,
                holder,
            )
            signals.task_deduplicated.send(
                sender=name, name=name, task_id=task_id, existing_id=holder, key=key
            )
            if preassigned:
                _settle_preassigned(baton, name, task_id, holder, options)
            result_cls = options.get("result_cls") or baton.app.AsyncResult
            return result_cls(holder)
        try:
            return send_task(name, args, kwargs, **options)
        except BaseException:
            # The message was not sent: nothing may keep its key.
            try:
                baton.release_unique(key, task_id)
            except Exception:
                logger.exception("could not free unique key %s after a failed publish", key)
            raise

    send_unique_task.__wrapped__ = send_task  # type: ignore[attr-defined]
    return send_unique_task


def _settle_preassigned(
    baton: Baton, name: str, task_id: str, holder: str, options: dict[str, Any]
) -> None:
    """Give ids that will never run a final state, so nothing waits on them forever.

    A caller that chose the id (a group or chord member, a chain's frozen ids) may wait
    on it rather than on the AsyncResult returned here: ``GroupResult.get()`` or the
    chain's last result would hang. Each such id gets a ``TaskDeduplicated`` failure
    that names the task that runs instead.
    """
    ids = [task_id]
    for sig in options.get("chain") or ():
        frozen = (sig.get("options") or {}).get("task_id") if isinstance(sig, dict) else None
        if frozen:
            ids.append(frozen)
    exc = TaskDeduplicated(
        f"{name} was not queued: task {holder} with the same unique key is queued or running",
        holder,
    )
    for dead_id in ids:
        try:
            baton.app.backend.mark_as_failure(dead_id, exc, call_errbacks=False)
        except Exception:  # the result backend is optional; its failure must not hide ours
            logger.exception("could not record %s as deduplicated", dead_id)
