"""``--autoscale``: a guarded job is written to a pool process at once (worker/pool/
prefork.py ``_write_now``) while the autoscaler, on a thread of its own, grows the pool
for a burst and shrinks it when idle (billiard terminates processes it sees without an
accepted job: one a job was just written to, and not yet accepted, is among them).

What that assumes of Celery: a job written to a process that is then terminated before
it accepted it is put back and written to another (AsynPool ``on_partial_read``), and a
lease its process took before the accept is given back or lapses (worker/pool/
at_start.py). Tested from outside: bursts of exclusive calls on a few keys, the pool
shrunk between them (``AUTOSCALE_KEEPALIVE``: idle processes go after 0.2 s, checked
every second): every call runs once, no two runs of one key overlap, every result is
SUCCESS, and the worker's log shows the pool shrinking and growing.
"""

from __future__ import annotations

import time

import pytest
from celery import states

from tests.support.observer import Observer, assert_no_overlap
from tests.support.waiting import wait_until
from tests.support.workers import Workers

BURSTS = 4
PER_BURST = 16  # four keys of four


@pytest.mark.timeout(240)  # 25 s alone; four times that on a loaded machine (CI: > 60 s)
def test_exclusive_calls_run_once_each_while_autoscale_grows_and_shrinks_the_pool(
    workers: Workers, observer: Observer
) -> None:
    from tests.apps.exclusive import ex_wait

    worker = workers.start(
        "tests.apps.exclusive",
        concurrency=4,
        extra_args=["--autoscale=4,1"],
        env={"AUTOSCALE_KEEPALIVE": "0.2"},
    )
    results = []
    for burst in range(BURSTS):
        batch = [ex_wait.delay(f"k{n % 4}", 0.05) for n in range(PER_BURST)]
        results += batch
        wait_until(
            lambda batch=batch: all(r.state in states.READY_STATES for r in batch),
            timeout=60,
            what=f"burst {burst} done",
        )
        time.sleep(2.5)  # not a wait: the autoscaler shrinks the idle pool meanwhile
    assert [r.state for r in results] == [states.SUCCESS] * len(results)
    runs = observer.wait_for(len(results), timeout=30)
    started = [s["task_id"] for s in observer.started()]
    assert sorted(started) == sorted(r.id for r in results), "a call ran twice or never"
    assert_no_overlap(runs)
    log = worker.log_text()
    assert "Scaling down" in log and "Scaling up" in log, worker.log_tail()
