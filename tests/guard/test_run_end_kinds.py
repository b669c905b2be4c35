"""Every kind of end of a guarded run is recorded before Celery acks it (issue 34.4).

A run whose worker dies between the end of its body and Celery's ack was never acked:
the broker delivers its message again, and the redelivery guard must refuse that copy.
It can only if the end was recorded by the process that ran the body, before it
reported back (``worker/pool/run_end.py``); the main process, which records it after
the ack, is the one that died. tests/guard/test_run_end.py holds it for a run that
returned; here for the two ends after which the same task id goes on:

* ``Task.replace``: the body sends its replacement (the same task id, a new publish)
  and raises ``Ignore``. A copy of the replaced step that runs again sends a second
  replacement: the rest of the chain runs twice (seen before: ``{3: 1, 2: 2, 1: 2,
  0: 2}`` runs per step).
* ``Task.retry``: the body sends its retry (the same task id and publish, one retry
  more) and raises ``Retry``. A copy of the retried attempt that runs again retries
  again. The retry itself must still run: it is the next attempt, not a copy.

and for ``Reject(requeue=False)``, an end Celery makes final (as a return).

The task stops its own main process (SIGSTOP) as its body ends; the test SIGKILLs that
worker a moment later and starts another, which receives the copy once the broker's
``visibility_timeout`` (10 s in this app) has passed.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

import pytest

from tests.support.celery_processes import WorkerProcess
from tests.support.observer import Observer
from tests.support.waiting import wait_until
from tests.support.workers import Workers

APP = "tests.apps.run_ends"


def _runs(observer: Observer, prefix: str) -> Counter[str]:
    return Counter(s["key"] for s in observer.started() if s["key"].startswith(prefix))


def _kill_after_the_end(workers: Workers, observer: Observer, key: str) -> WorkerProcess:
    """Wait for the run to stop its main process, let its pool process finish, kill the
    worker and start another, which receives the copy (if any) in the next 10 s."""
    from tests.apps import run_ends

    first_worker = workers.started[-1]
    wait_until(
        lambda: observer._redis.exists(run_ends.main_stopped_mark(key)),
        30,
        "the run to stop its main process",
    )
    time.sleep(1.0)  # the pool process finishes its run meanwhile
    assert isinstance(first_worker, WorkerProcess)
    first_worker.kill()
    return workers.start(APP, concurrency=2)


def _copy_judged(worker: WorkerProcess, task_id: str, ran_again: Callable[[], bool]) -> None:
    """Wait until the copy of ``task_id``'s message was skipped, or ran (the bug)."""
    wait_until(
        lambda: f"{task_id}] skipped" in worker.log_text() or ran_again(),
        60,
        "the copy to be delivered again",
    )


@pytest.mark.timeout(150)
def test_a_replaced_step_whose_worker_died_before_the_ack_does_not_run_again(
    workers: Workers, observer: Observer
) -> None:
    from tests.apps import run_ends

    workers.start(APP, concurrency=2)
    head = run_ends.replace_main_dies.delay("rp", 3)
    second_worker = _kill_after_the_end(workers, observer, "rp")
    # The replacement waits in the parked queue: the copy of the replaced step comes first.
    _copy_judged(second_worker, head.id, lambda: _runs(observer, "rp:")["rp:3"] > 1)
    time.sleep(0.5)  # the copy, if it was being run rather than skipped, has started now
    assert _runs(observer, "rp:") == {"rp:3": 1}, "the replaced step ran again"

    # The replacement is a new publish of the same task id: the rest of the chain runs,
    # each step once.
    workers.start(APP, concurrency=2, queues=run_ends.PARKED)
    assert head.get(timeout=60) == "done"
    time.sleep(1.0)  # a second replacement, if any, has run its steps now
    runs = _runs(observer, "rp:")
    assert runs == {"rp:3": 1, "rp:2": 1, "rp:1": 1, "rp:0": 1}, f"runs per step: {runs}"


@pytest.mark.timeout(150)
def test_a_retried_attempt_whose_worker_died_before_the_ack_does_not_run_again(
    workers: Workers, observer: Observer
) -> None:
    from tests.apps import run_ends

    workers.start(APP, concurrency=2)
    first = run_ends.retry_main_dies.delay("rt")
    second_worker = _kill_after_the_end(workers, observer, "rt")
    # The retry waits in the parked queue: the copy of the first attempt comes first.
    _copy_judged(second_worker, first.id, lambda: _runs(observer, "rt:")["rt:0"] > 1)
    time.sleep(0.5)  # the copy, if it was being run rather than skipped, has started now
    assert _runs(observer, "rt:") == {"rt:0": 1}, "the retried attempt ran again"

    # The retry is the next attempt, not a copy: it runs, once.
    workers.start(APP, concurrency=2, queues=run_ends.PARKED)
    assert first.get(timeout=30) == "done"
    assert _runs(observer, "rt:") == {"rt:0": 1, "rt:1": 1}


@pytest.mark.timeout(150)
def test_a_rejected_run_whose_worker_died_before_the_reject_does_not_run_again(
    workers: Workers, observer: Observer
) -> None:
    from tests.apps import run_ends

    workers.start(APP, concurrency=2)
    first = run_ends.reject_main_dies.delay("rj")
    second_worker = _kill_after_the_end(workers, observer, "rj")
    _copy_judged(second_worker, first.id, lambda: _runs(observer, "rj")["rj"] > 1)
    time.sleep(0.5)  # the copy, if it was being run rather than skipped, has started now
    assert _runs(observer, "rj") == {"rj": 1}, "the rejected run ran again"
