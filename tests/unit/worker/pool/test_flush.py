"""Celery before 5.6 empties the prefork pool's job cache when the broker connection is
lost, running jobs included (worker/pool/flush.py): the wrapped flush keeps those."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from celery_baton.worker.pool.flush import keep_running_jobs


def _pool(cache: dict[int, Any]) -> Any:
    """A TaskPool's shape: ``flush`` as Celery 5.5's (the whole cache goes) and the
    billiard pool's ``_cache``."""
    return SimpleNamespace(flush=cache.clear, _pool=SimpleNamespace(_cache=cache))


def test_a_flush_before_celery_5_6_keeps_the_jobs_a_process_accepted() -> None:
    running, waiting = SimpleNamespace(_accepted=True), SimpleNamespace(_accepted=False)
    cache: dict[int, Any] = {1: running, 2: waiting}
    pool = _pool(cache)
    assert keep_running_jobs(pool, version=(5, 5))
    pool.flush()
    assert cache == {1: running}  # its result will find it; the unwritten one goes


def test_celery_5_6_and_later_are_left_alone() -> None:
    cache: dict[int, Any] = {1: SimpleNamespace(_accepted=True)}
    pool = _pool(cache)
    assert not keep_running_jobs(pool, version=(5, 6))
    pool.flush()
    assert cache == {}


def test_a_pool_without_a_flush_is_left_alone() -> None:
    assert not keep_running_jobs(SimpleNamespace(), version=(5, 5))
    assert not keep_running_jobs(None, version=(5, 5))
