"""A guarded run's end, recorded by the pool process that ran it.

The main process records a run's end when Celery tells it the job is over
(``worker/request.py``). Between the pool process returning and that moment, the main
process may die: killed, or its consumer lost on an unrecoverable error (Celery 5.7
and kombu can die that way on a broker restart). The message was never acknowledged,
so the broker delivers it again, and without a record of the run the redelivery guard
would run it a second time.

So the process that ran the task writes the record itself, right after the task body
ended and its result was stored (``task_postrun``), before it reports back: the done
marker (a copy of the message is then acked without running), and the unique claim
freed (its copy will not run, so the key is free for the next publish). Only for an end
that Celery makes final whatever it does next: the body returned (``SUCCESS``) or raised
(``FAILURE``); a message Celery then acks, or rejects without requeue. A retry, a
``Reject`` or an ``Ignore`` is left to the main process, which reads what Celery did.
A pool process that dies inside the task records nothing: its run did not end.

The main process records the same again when it learns of the end (idempotent); the
run's leases are left to it (a lease freed here while its renewals go on there could be
mistaken for one the store forgot). Without a pool (solo, threads) the task runs in the
main process, which records the end a moment later itself: nothing is written here.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from celery import signals, states

from celery_baton.core.gate import Release
from celery_baton.core.policy.model import RunPlan, TaskPolicy
from celery_baton.parts import parts_for

logger = logging.getLogger("celery_baton.worker")

RUN_END_FIELD = "baton_run_end"

#: The body ended and Celery will not deliver this task id again for it.
_ENDED_FOR_GOOD = frozenset({states.SUCCESS, states.FAILURE})


def mark(request_dict: dict[str, Any], policy: TaskPolicy, plan: RunPlan) -> None:
    """Main process, as the run starts: what its pool process records at its end."""
    if plan.done_key is None:  # no redelivery guard: a copy would run anyway
        return
    unique_key = policy.freed_at_end(plan)
    request_dict[RUN_END_FIELD] = (
        os.getpid(),
        plan.owner,
        plan.done_key,
        policy.redelivery_retention,
        unique_key or "",
        plan.done_stamp,
        plan.done_link,
    )


def record_run_end(sender: Any = None, task: Any = None, state: str = "", **_: Any) -> None:
    """``task_postrun``: in the pool process, record a guarded run that ended for good."""
    if task is None or state not in _ENDED_FOR_GOOD:
        return
    fields = getattr(task.request, RUN_END_FIELD, None)
    if not fields:
        return
    main_pid, owner, done_key, retention, unique_key, stamp, link = fields
    if main_pid == os.getpid():  # no pool: the main process records it itself
        return
    release = Release(
        (),
        owner,
        done_key,
        retention,
        unique_key or None,
        task.request.id,
        done_stamp=stamp,
        done_link=link,
    )
    try:
        parts_for(task.app).gate.release_many([release])
    except Exception as exc:  # the main process records it too, when it learns of the end
        logger.warning(
            "baton: %s[%s] ended; recording it failed: %s", task.name, task.request.id, exc
        )


def install() -> None:
    signals.task_postrun.connect(record_run_end, weak=False, dispatch_uid="baton-run-end")
