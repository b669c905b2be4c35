"""``celery control pool_restart`` (with ``worker_pool_restarts``): billiard tells every
prefork process to leave, an idle one at its next look for a job (once a second), a
busy one after its job, and starts new ones in their place. A process told to leave is
idle and up by every count the main process keeps until it is gone: a job written to it
then is never read by it.

What that assumes of Celery: such a job is given to another process, and a lease its
process took for it is given back or lapses. Tested from outside: bursts of exclusive
calls on a few keys, the pool restarted in the middle of each (three times in a row):
every call runs once, no two runs of one key overlap, every result is SUCCESS, and the
pool's processes were replaced.
"""

from __future__ import annotations

import time
from typing import Any

import kombu.exceptions
import pytest
import redis
from celery import states

from tests.support.observer import Observer, assert_no_overlap
from tests.support.waiting import wait_until
from tests.support.workers import Workers

BURSTS = 2
PER_BURST = 24  # four keys of six


@pytest.mark.timeout(240)
def _restart_pool(app: Any) -> Any:
    """``celery control pool_restart``, sent again on a broker connection of this test
    process that an earlier test cut (a broker restarted or its clients killed: a CI
    rehearsal, 2026-12-01); a restart more is one more restart, which this test makes."""
    for attempt in range(3):
        try:
            return app.control.broadcast("pool_restart", reply=True, timeout=5)
        except (OSError, redis.RedisError, kombu.exceptions.OperationalError):
            if attempt == 2:
                raise
            time.sleep(0.2)
    return None


def test_exclusive_calls_run_once_each_across_pool_restarts(
    workers: Workers, observer: Observer
) -> None:
    from tests.apps.exclusive import app, ex_wait

    worker = workers.start("tests.apps.exclusive", concurrency=3, env={"TEST_POOL_RESTARTS": "1"})
    first_pids = set(worker.pool_pids())
    results = []
    for burst in range(BURSTS):
        batch = [ex_wait.delay(f"k{n % 4}", 0.1) for n in range(PER_BURST)]
        results += batch
        observer.starts_of(f"k{burst % 4}", 1, timeout=30)
        for _ in range(3):
            replies = _restart_pool(app)
            assert replies and all("ok" in next(iter(r.values())) for r in replies), replies
            time.sleep(0.3)
        wait_until(
            lambda batch=batch: all(r.state in states.READY_STATES for r in batch),
            timeout=90,
            what=f"burst {burst} done",
        )
    assert [r.state for r in results] == [states.SUCCESS] * len(results)
    runs = observer.wait_for(len(results), timeout=30)
    started = [s["task_id"] for s in observer.started()]
    assert sorted(started) == sorted(r.id for r in results), "a call ran twice or never"
    assert_no_overlap(runs)
    assert not first_pids & set(worker.pool_pids()), "the pool was not restarted"
