"""A worker stopped by a cold shutdown after Celery 5.5's soft shutdown (SIGQUIT, or
SIGTERM under ``REMAP_SIGTERM=SIGQUIT`` as container deployments set it): Celery waits
``worker_soft_shutdown_timeout`` for the running tasks, then cancels each ``acks_late``
one still running and leaves its message unacknowledged, for another worker ("requeue
long-running tasks to be picked up by another worker"). The redelivery guard and the
exclusive key must keep that promise: the copy runs on the other worker (the cancelled
run did not end: it is not "already run"), never beside the cancelled run.

Celery keeps it on the prefork pool only (measured with the plain task beside, every
pool): threads and solo cannot stop a body, which runs to its end; on gevent and
eventlet Celery's soft shutdown fails in its signal handler (a blocking sleep in the
event loop) and the worker exits without cancelling. There the test asks what the user
then needs: the call ran once, as with Celery alone, and its key is free for the next.

Judged by the observer: the call starts again, on the other worker, and its runs do
not overlap.
"""

from __future__ import annotations

import signal

import pytest

from tests.support.celery_processes import WorkerProcess
from tests.support.observer import Observer, assert_no_overlap
from tests.support.pools import ALL_POOLS
from tests.support.waiting import wait_until
from tests.support.workers import Workers

APP = "tests.apps.cold_shutdown"

#: How each prefork deployment is started: Celery's defaults, recycled processes, an
#: autoscaled pool.
PREFORK = {
    "default": [],
    "max-tasks-per-child": ["--max-tasks-per-child", "1"],
    "autoscale": ["--autoscale", "2,1"],
}


def _cold_shutdown(stopped: WorkerProcess, how: str) -> None:
    stopped._proc.send_signal(signal.SIGQUIT if how == "sigquit" else signal.SIGTERM)
    wait_until(lambda: stopped._proc.poll() is not None, 60, "the stopped worker to exit")


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("task", "deployment", "how"),
    [
        ("plain", "default", "sigquit"),  # Celery's own promise, as the assumption
        ("ex_guarded", "default", "sigquit"),
        ("ex_guarded", "default", "remapped-sigterm"),
        ("ex_guarded", "max-tasks-per-child", "sigquit"),
        ("ex_guarded", "autoscale", "sigquit"),
    ],
)
def test_a_task_cancelled_by_a_cold_shutdown_runs_again_on_another_worker(
    task: str, deployment: str, how: str, workers: Workers, observer: Observer
) -> None:
    from tests.apps import cold_shutdown

    key = f"cold-{task}-{deployment}-{how}"
    env = {"REMAP_SIGTERM": "SIGQUIT"} if how == "remapped-sigterm" else {}
    stopped = workers.start(APP, concurrency=2, env=env, extra_args=PREFORK[deployment])
    getattr(cold_shutdown, task).delay(key, 8.0)
    first = observer.starts_of(key, 1, timeout=30)[0]
    workers.start(APP, concurrency=2)
    _cold_shutdown(stopped, how)
    starts = observer.starts_of(key, 2, timeout=60)
    assert starts[1]["task_id"] == first["task_id"]
    runs = observer.runs_of(key, 2, timeout=60)  # the cancelled run's end, and the copy's
    assert_no_overlap(runs)
    assert runs[-1].pid == starts[1]["pid"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("pool", [p for p in ALL_POOLS if p != "prefork"])
def test_after_a_cold_shutdown_the_call_ran_once_and_its_key_is_free(
    pool: str, workers: Workers, observer: Observer
) -> None:
    from tests.apps import cold_shutdown

    key = f"cold-{pool}"
    stopped = workers.start(APP, pool=pool, concurrency=2)
    cold_shutdown.ex_guarded.delay(key, 4.0)
    observer.starts_of(key, 1, timeout=30)
    workers.start(APP, concurrency=2)
    _cold_shutdown(stopped, "sigquit")
    # The next call of the key runs (no lease of the stopped run left behind)...
    assert cold_shutdown.ex_guarded.delay(key, 0.1).get(timeout=60)
    runs = observer.runs_of(key, 1, timeout=30)
    # ... and the first one ran once, as with Celery alone on this pool.
    assert len(observer.starts_of(key, 2)) == 2
    assert_no_overlap(runs)
