"""Runs going on across a lost broker connection keep their end (Celery before 5.6).

When the broker connection is lost, Celery's consumer flushes the prefork pool
(``Consumer.on_close`` -> ``AsynPool.flush``) to drop the jobs not yet written to a
process: the broker delivers their messages again. Before Celery 5.6 that flush emptied
the pool's whole job cache, the jobs a process was running included. Their results
then arrive for a job the pool no longer knows and are dropped: the worker's main
process never learns that those runs ended. Celery leaves them active for ever; for
celery-baton, their exclusive keys and concurrency slots stay held (and renewed) for
the worker's life, and every later run of the key waits.

So, on those versions, the flush keeps the jobs a process had accepted (what Celery
5.6 does itself: it discards only the others). The ones not yet accepted go as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import celery

from celery_baton import internals

logger = logging.getLogger("celery_baton.worker")

#: The first Celery whose flush keeps running jobs.
FIXED_IN = (5, 6)


def keep_running_jobs(task_pool: Any, version: tuple[int, ...] | None = None) -> bool:
    """Wrap ``task_pool.flush`` (the prefork pool of a Celery before 5.6) so that jobs
    a pool process accepted stay in its job cache; whether it was wrapped."""
    if tuple(version or celery.VERSION[:2]) >= FIXED_IN:
        return False
    cache = internals.pool_job_cache(task_pool)
    if cache is None:
        return False
    flush: Callable[[], Any] = task_pool.flush

    def flush_keeping_running_jobs() -> Any:
        running = {job_id: job for job_id, job in cache.items() if getattr(job, "_accepted", 0)}
        try:
            return flush()
        finally:
            kept = [job_id for job_id in running if job_id not in cache]
            for job_id in kept:
                cache[job_id] = running[job_id]
            if kept:
                logger.info(
                    "baton: %d runs going on kept in the pool across the lost broker "
                    "connection (Celery before 5.6 would drop their ends)",
                    len(kept),
                )

    task_pool.flush = flush_keeping_running_jobs
    return True
