"""The prefork pool celery-baton starts, or the one line a worker is refused with
(worker/pool/prefork.py; its processes are driven by real workers in
tests/limits/test_recycled_pool.py and tests/limits/test_grant_time_limits.py)."""

from __future__ import annotations

from typing import Any

import pytest
from celery.concurrency.prefork import TaskPool

from celery_baton.worker.pool import prefork


def task_pool(**options: Any) -> TaskPool:
    return TaskPool(limit=1, **options)


def test_celerys_prefork_pool_is_started_as_celery_baton_needs_it() -> None:
    pool = task_pool()
    assert prefork.install(pool) is None
    assert pool.Pool is prefork.ReadyAsynPool
    assert pool.BlockingPool is prefork.JudgingBlockingPool
    assert TaskPool.Pool is not prefork.ReadyAsynPool  # this worker's pool only


@pytest.mark.parametrize("strategy", ["fast", "fcfs"])
def test_a_pool_that_writes_jobs_to_busy_processes_is_refused(strategy: str) -> None:
    refused = prefork.install(task_pool(sched_strategy=strategy))
    assert refused is not None and repr(strategy) in refused and '"fair"' in refused


def test_a_pool_class_of_its_own_is_refused() -> None:
    pool = task_pool()
    pool.Pool = type("Mine", (prefork.ReadyAsynPool.__mro__[1],), {})
    refused = prefork.install(pool)
    assert refused is not None and "not Celery's prefork pool" in refused


def test_a_pool_already_started_is_refused() -> None:
    pool = task_pool()
    pool._pool = object()
    refused = prefork.install(pool)
    assert refused is not None and "started" in refused


def test_a_job_that_is_not_a_celery_tasks_is_left_alone() -> None:
    from celery_baton.worker.pool.at_start import judge_before_accept

    judge_before_accept((2, (1, None, print, (), {})))  # no Celery request in it
    judge_before_accept((2, (1, None, print, ("t", "id", {"other": 1}), {})))
