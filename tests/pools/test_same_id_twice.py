"""Two runs of one task id in one worker process (a redelivered copy beside its first
delivery: the broker paused, its acks failed), on the pools that run bodies in the
worker's own process (threads, gevent, eventlet).

Found by the nemesis soak (eventlet, the broker SIGSTOPped 7.5 s): an exclusive key ran
twice at once. A run's end is recorded by the thread or greenlet that ran it, found by
its task id: the first copy, ending after the second had started, took the second's
record and freed its lease, and the key's next call was granted beside it.

Here: copy A of an ``exclusive_conflict="wait"`` task runs 1 s and its end lingers
0.5 s after its result (``after_return``); copy B (the same task id) waits for the key
and starts when A's result frees it; call C of the same key waits too. C must not
start while B runs.
"""

from __future__ import annotations

import importlib.util
import time

import pytest

from tests.support.observer import Observer, assert_no_overlap
from tests.support.workers import Workers

APP = "tests.apps.exclusive"


@pytest.mark.parametrize("pool", ["threads", "gevent", "eventlet"])
def test_two_runs_of_one_task_id_keep_their_own_leases(
    workers: Workers, observer: Observer, pool: str
) -> None:
    # Looked up, not imported: eventlet imported in the test process warns at every
    # fork a later test makes (an error under the suite's warning filter).
    if pool != "threads" and importlib.util.find_spec(pool) is None:
        pytest.skip(f"{pool} is not installed")
    from tests.apps.exclusive import ex_slow_end

    workers.start(APP, pool=pool, concurrency=4)
    first = ex_slow_end.apply_async(("twice", 1.0))
    observer.starts_of("twice", 1, timeout=30)
    ex_slow_end.apply_async(("twice", 1.0), task_id=first.id)  # the copy: same id
    time.sleep(0.3)  # the copy is received before the next call (it asks first)
    ex_slow_end.apply_async(("twice", 0.5))
    runs = observer.runs_of("twice", n=3, timeout=60)
    assert_no_overlap(runs)
