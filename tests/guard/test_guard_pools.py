"""The redelivery guard on every pool: a run whose worker died between its end and
Celery's ack does not run again.

tests/guard/test_run_end_kinds.py holds this on Celery's default pool, stopping the
main process while its pool process ends the run. What the guard assumes of a pool is
that the run's end is recorded where the body ran, before anything can ack it
(``worker/pool/run_end.py``: before the result is stored, or at ``task_postrun``):

* prefork: in the pool process, which goes on after its main process stopped; also
  with its processes recycled (``--max-tasks-per-child``: the recording process was
  forked after the worker started) or grown and shrunk (``--autoscale``);
* threads, gevent, eventlet, solo: in the main process itself, on the run's thread or
  greenlet, whose own request context carries what to record.

Here the worker's main process is stopped after ``task_postrun`` (its end recorded, its
result stored, not acked: ``acks_late``), SIGKILLed, and another worker receives the
copy once the broker's visibility timeout (10 s in this app) has passed.
The copy must be skipped; for a retried attempt the retry, the next attempt, runs once.
"""

from __future__ import annotations

import time

import pytest

from tests.guard.test_run_end_kinds import _copy_judged, _runs
from tests.support.celery_processes import WorkerProcess
from tests.support.observer import Observer
from tests.support.pools import POOLS_AND_RECYCLED, TIME_LIMIT_POOLS, pool_setting
from tests.support.waiting import wait_until
from tests.support.workers import Workers

APP = "tests.apps.run_ends"


def _start(workers: Workers, pool: str, **kw: object) -> WorkerProcess:
    name, extra, env = pool_setting(pool)
    return workers.start(APP, pool=name, concurrency=2, extra_args=extra, env=env, **kw)


def _kill_once_stopped(workers: Workers, observer: Observer, key: str) -> WorkerProcess:
    """Wait until the run stopped its worker's main process after its end, kill that
    worker and start another, which receives the copy (if any)."""
    from tests.apps import run_ends

    first_worker = workers.started[-1]
    wait_until(
        lambda: observer._redis.exists(run_ends.main_stopped_mark(key)),
        30,
        "the run to stop its worker after its end",
    )
    assert isinstance(first_worker, WorkerProcess)
    first_worker.kill()
    # The copy is judged by a prefork worker: what is under test is where the first run's
    # end was recorded. (A gevent or eventlet worker consumes without kombu's event loop,
    # and kombu's redis transport then restores unacked messages only when a poll finds
    # nothing to read, which its own BRPOP timeouts never let happen.)
    return workers.start(APP, concurrency=2)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("pool", POOLS_AND_RECYCLED)
def test_a_returned_run_whose_worker_died_before_the_ack_does_not_run_again(
    workers: Workers, observer: Observer, pool: str
) -> None:
    from tests.apps import run_ends

    _start(workers, pool)
    result = run_ends.returns_then_main_stops.delay("rs")
    second = _kill_once_stopped(workers, observer, "rs")
    _copy_judged(second, result.id, lambda: _runs(observer, "rs")["rs"] > 1)
    time.sleep(0.5)  # the copy, if it was being run rather than skipped, has started now
    assert _runs(observer, "rs") == {"rs": 1}, "the run ran again"
    assert result.get(timeout=30) == "done"


@pytest.mark.timeout(150)
@pytest.mark.parametrize("pool", POOLS_AND_RECYCLED)
def test_a_retried_attempt_whose_worker_died_before_the_ack_does_not_run_again(
    workers: Workers, observer: Observer, pool: str
) -> None:
    from tests.apps import run_ends

    _start(workers, pool)
    first = run_ends.retries_then_main_stops.delay("rt")
    second = _kill_once_stopped(workers, observer, "rt")
    # The retry waits in the parked queue: the copy of the first attempt comes first.
    _copy_judged(second, first.id, lambda: _runs(observer, "rt:")["rt:0"] > 1)
    time.sleep(0.5)  # the copy, if it was being run rather than skipped, has started now
    assert _runs(observer, "rt:") == {"rt:0": 1}, "the retried attempt ran again"

    # The retry is the next attempt, not a copy: it runs, once.
    _start(workers, pool, queues=run_ends.PARKED)
    assert first.get(timeout=30) == "done"
    assert _runs(observer, "rt:") == {"rt:0": 1, "rt:1": 1}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("pool", TIME_LIMIT_POOLS)
def test_a_run_past_its_time_limit_whose_worker_died_before_the_ack_does_not_run_again(
    workers: Workers, observer: Observer, pool: str
) -> None:
    """A run past its hard time limit ends in the main process, which stores its FAILURE
    and then acks it (``acks_late``): the worker stops right after the FAILURE, is
    killed, and the copy of its message comes back. It must be skipped: the done marker
    was recorded before the FAILURE, there (the process that ran the body could not)."""
    from tests.apps import run_ends

    _start(workers, pool)
    result = run_ends.guarded_past_its_limit_stops_at_failure.delay("tl")
    second = _kill_once_stopped(workers, observer, "tl")
    _copy_judged(second, result.id, lambda: _runs(observer, "tl")["tl"] > 1)
    time.sleep(0.5)  # the copy, if it was being run rather than skipped, has started now
    assert _runs(observer, "tl") == {"tl": 1}, "the run past its time limit ran again"
