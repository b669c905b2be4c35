"""A run that ended is recorded even if its worker's main process dies right after.

The main process learns of a run's end when the pool process reports back, and only
then records it (done marker, unique claim freed, ack). A main process that dies in
between (SIGKILLed; or its consumer lost on an unrecoverable error, as Celery 5.7 and
kombu can on a broker restart: the 30-minute soak saw guarded ids run twice, 15 s
apart) never acks the message, and the broker delivers it again. Under the redelivery
guard that copy must not run: the pool process records the end itself
(``worker/pool/run_end.py``), and a unique key is then free for the next publish.

The task stops its own main process (SIGSTOP) as its body returns; the test SIGKILLs
that worker a moment later and starts another, which receives the copy once the
broker's ``visibility_timeout`` (10 s in this app) has passed.
"""

from __future__ import annotations

import time

import pytest

from tests.support.observer import Observer
from tests.support.waiting import wait_until
from tests.support.workers import Workers

APP = "tests.apps.ackfail"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("task_name", ["guarded_main_dies", "unique_main_dies"])
def test_a_run_that_ended_as_its_main_process_died_does_not_run_again(
    workers: Workers, observer: Observer, task_name: str
) -> None:
    from tests.apps import ackfail

    task = getattr(ackfail, task_name)
    first_worker = workers.start(APP, concurrency=2)
    first = task.delay("kd")
    wait_until(
        lambda: observer._redis.exists(ackfail.main_stopped_mark("kd")),
        30,
        "the run to stop its main process",
    )
    time.sleep(1.0)  # the pool process finishes its run meanwhile
    first_worker.kill()
    assert [s["task_id"] for s in observer.started()] == [first.id]

    if task_name == "unique_main_dies":
        again = task.delay("kd")
        assert again.id != first.id, "deduplicated into a run that had ended"

    second_worker = workers.start(APP, concurrency=2)
    # The broker gives the message back within its visibility_timeout (10 s) plus a
    # restore scan: the copy is acked without running, or (the bug) runs again.
    wait_until(
        lambda: (
            f"{first.id}] skipped" in second_worker.log_text()
            or [s["task_id"] for s in observer.started()].count(first.id) > 1
        ),
        60,
        "the copy to be delivered again",
    )
    time.sleep(0.5)  # the copy, if it was being run rather than skipped, has started now
    ran = [s["task_id"] for s in observer.started()]
    assert ran.count(first.id) == 1, f"a run that had ended ran again: {ran}"
