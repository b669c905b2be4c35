"""A key's backlog of full batches starts side by side on a worker's free processes.

A worker claimed one batch per key per tick (every ``batch_wait / 4``, at most 50 ms): a
key's backlog of full batches started one tick after another, so a key never ran more
than 20 batches a second in one worker, whatever its free processes (the bound of the
1 ms-item drain in docs/benchmarks.md#batching). A tick now claims as many due batches
as the worker has free processes. Judged from outside: 20 full batches waiting for a
worker of 20 free threads, their bodies' starts (the observer's clock), and every call
in exactly one run with its caller's own result.
"""

from __future__ import annotations

from tests.batching.test_batching import assert_each_call_once, call_ids, settle
from tests.support.observer import Observer
from tests.support.waiting import broadcast
from tests.support.workers import Workers

APP = "tests.apps.batch_claims"
BATCHES = 20
SIZE = 5  # side_by_side's batch_size


def test_a_backlog_of_full_batches_starts_side_by_side(
    workers: Workers, observer: Observer
) -> None:
    from tests.apps.batch_claims import side_by_side

    workers.start(APP, concurrency=BATCHES, pool="threads", queues="not-yet")
    calls = BATCHES * SIZE
    results = [side_by_side.apply_async(kwargs={"account": "a", "doc": n}) for n in range(calls)]
    replies = broadcast(
        side_by_side.app,
        lambda: side_by_side.app.control.add_consumer("celery", reply=True, timeout=10, limit=1),
    )
    assert len(replies) == 1, f"the worker does not consume the task queue: {replies}"
    runs = settle(observer, "side_by_side", calls)
    assert_each_call_once(runs, [r.id for r in results])
    assert [r.get(timeout=30) for r in results] == list(range(calls))
    assert all(len(call_ids(r)) == SIZE for r in runs), [len(call_ids(r)) for r in runs]
    starts = sorted(r.start for r in runs)
    spread = (starts[-1] - starts[0]) / 1e6
    print(f"\n{len(runs)} batches of {SIZE} started within {spread:.3f} s")
    # One claim per tick: 19 ticks of 50 ms at least between the first and the last
    # start (0.95 s). Claimed together, they start within the pool's hand-over of each
    # other (a few ms; a tick or two when the messages came in over two ticks).
    assert spread < 0.4, f"{BATCHES} full batches started over {spread:.2f} s: one per tick"
