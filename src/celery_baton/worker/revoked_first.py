"""A revoke frees a unique key held by a task that did not start, before Celery stores
its REVOKED.

Celery 5.6 and later store REVOKED as soon as a worker hears a revoke (its ``revoke``
control handler), no longer when the message is discarded: a task that waits for its
countdown or ETA, in this worker's prefetch, or held by celery-baton is REVOKED for its
caller at once, and its message is discarded only when its turn comes. Its unique claim
was freed at that discard: a caller who saw REVOKED and published again got the revoked
task's id back for as long as the countdown ran (12 of 12 such publishes,
tests/unique/test_after_the_result.py).

So this worker's handler first frees the claim of each revoked task it holds that no pool
process was given, waiting for the store, then lets Celery's handler store REVOKED. A
task still in the broker, or held by another worker, frees its key when a worker
discards it (every worker that hears the revoke stores REVOKED, the holder perhaps not
first): said in the unique guide.
"""

from __future__ import annotations

import logging
from typing import Any

from celery.utils.functional import maybe_list

from celery_baton import internals
from celery_baton.worker.pool.run_end import record_end_now
from celery_baton.worker.request import reached_the_pool, revoked_release

logger = logging.getLogger("celery_baton")

_WRAPPED_ATTR = "_baton_frees_claims"


def free_claims_on_revoke(panel: dict[str, Any]) -> None:
    """Wrap the worker's ``revoke`` control handler (``panel``: Celery's ``Panel.data``)."""
    handler = panel.get("revoke")
    if handler is None or getattr(handler, _WRAPPED_ATTR, False):
        return

    def revoke(state: Any, task_id: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            free_held_claims(task_id)
        except Exception:  # the revoke itself must go on
            logger.exception("baton: freeing the unique keys of revoked %s failed", task_id)
        return handler(state, task_id, *args, **kwargs)

    setattr(revoke, _WRAPPED_ATTR, True)
    revoke.__doc__ = handler.__doc__
    panel["revoke"] = revoke


def free_held_claims(task_ids: Any) -> None:
    """Free the unique claims of the revoked ``task_ids`` this worker holds unstarted."""
    found = internals.worker_requests()
    if found is None:
        return
    requests, active = found
    for task_id in maybe_list(task_ids) or ():
        request = requests.get(task_id)
        if (
            request is None
            or request in active
            or reached_the_pool(request)  # a job written to a pool process runs all the same
        ):
            continue
        release = revoked_release(request)
        if release is not None:
            record_end_now(request.task.app, release)
