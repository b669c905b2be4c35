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

import pytest

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


def split_calls(observer: Observer, *, filled_before: int) -> tuple[int, list[float]]:
    """40 calls of ``fill`` on one key, half to worker A's queue (``qa``), half to B's
    (``qb``), interleaved so that batches hold calls of both workers: every call runs
    once with its own result. The publish's instant, and the start after it (s, in
    order) of each batch that holds a call of B's: B can carry those at once (a batch
    of A's calls alone, which a loaded machine's timing can make, waits for A)."""
    from tests.apps.batching import fill

    calls = 40
    published = observer.now_us()
    results = [
        fill.apply_async(kwargs={"account": "k", "doc": d}, queue=["qa", "qb"][d % 2])
        for d in range(calls)
    ]
    assert [r.get(timeout=90) for r in results] == [d * 2 for d in range(calls)]
    runs = [r for r in settle(observer, "fill", filled_before + calls) if r.key == "fill:k"]
    assert_each_call_once(runs, [r.id for r in results])
    of_b = {r.id for r in results[1::2]}
    carried_by_b = [r for r in runs if of_b & set(call_ids(r))]
    assert carried_by_b, "no batch held a call of B's: nothing was tested"
    return published, sorted((r.start - published) / 1e6 for r in carried_by_b)


#: How long a pool process of the recycled worker takes to exit after its one task.
SLOW_EXIT = 25


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    "recycle",
    ["--max-tasks-per-child=1", "--max-memory-per-child=1"],
    ids=["max-tasks", "max-memory"],
)
def test_a_worker_whose_processes_are_leaving_leaves_due_batches_to_a_free_one(
    workers: Workers, observer: Observer, recycle: str
) -> None:
    """Worker A (``-c 2 --max-tasks-per-child=1``) ran a batch on each process, and each
    takes 25 s to exit (a slow ``worker_process_shutdown``): no process of A can start a
    batch until its replacement is forked then. Worker B has two free processes. Calls of
    one key come in, half held by each (A consumes a queue of its own, B another): every
    batch can be carried by B at once. A claimed due batches for processes it counted
    free (its pool's size less its running requests, a process leaving counted free),
    and one per tick besides (at least one): they waited for A's replacements. Judged by
    the observer: every batch starts within 8 s of the publish (about 0.2 s), not after
    the 25 s exit, and every call runs once."""
    from tests.apps.batching import fill
    from tests.batching.test_batching import APP as BATCHING

    worker_a = workers.start(
        BATCHING,
        concurrency=2,
        queues="qa",
        extra_args=[recycle],
        env={"BATCH_SLOW_EXIT": str(SLOW_EXIT)},
    )
    # Two full batches (fill: 10 a batch), one in each of A's processes: both leave.
    warm = [fill.apply_async(kwargs={"account": "warm", "doc": d}, queue="qa") for d in range(20)]
    assert [r.get(timeout=30) for r in warm] == [d * 2 for d in range(20)]
    assert len({r.pid for r in observer.runs() if r.key == "fill:warm"}) == 2
    left = observer.now_us()
    workers.start(BATCHING, concurrency=2, queues="qb")
    published, late = split_calls(observer, filled_before=20)
    # Still within A's processes' exit when the calls came (else nothing was tested).
    assert (published - left) / 1e6 < SLOW_EXIT - 10, "B took too long to start"
    assert late[-1] < 8, (
        f"batches started {[round(s, 2) for s in late]} s after the publish: some waited "
        f"for worker {worker_a.hostname}'s leaving processes ({SLOW_EXIT} s to exit)"
    )


#: How long the busy worker's only process stays busy with another task.
BUSY = 20


@pytest.mark.timeout(150)
@pytest.mark.parametrize("pool", ["threads", "gevent"])
def test_a_worker_whose_only_process_is_busy_leaves_due_batches_to_a_free_one(
    workers: Workers, observer: Observer, pool: str
) -> None:
    """The same on the pools without a prefork pool's own count of its processes: worker
    A (``-c 1``) runs a 20 s task on its only thread (greenlet); worker B has two free.
    Calls of one key come in, half held by each: every batch can be carried by B at once.
    A claimed one due batch per tick whatever its free processes (at least one each
    tick): they waited for A's process. Judged by the observer: every batch starts
    within 8 s of the publish (B carries them at once), and every call runs once."""
    from tests.apps.batching import occupy
    from tests.batching.test_batching import APP as BATCHING

    workers.start(BATCHING, pool=pool, concurrency=1, queues="qa")
    workers.start(BATCHING, pool=pool, concurrency=2, queues="qb")
    occupy.apply_async((BUSY,), queue="qa")
    busy_since = observer.starts_of("occupy")[0]["start"]
    published, late = split_calls(observer, filled_before=0)
    # A's process was still busy when the calls came (else nothing was tested).
    assert (published - busy_since) / 1e6 < BUSY - 10, "the calls came too late"
    assert late[-1] < 8, (
        f"batches started {[round(s, 2) for s in late]} s after the publish: some waited "
        f"for the busy worker's only process ({BUSY} s)"
    )


@pytest.mark.timeout(150)
def test_a_gevent_consumer_blocked_by_a_full_pool_keeps_its_running_batch(
    workers: Workers, observer: Observer
) -> None:
    """On gevent a consumer handing a task to a full pool waits in gevent's ``spawn``
    until a greenlet frees. Worker A (``-c 2``) runs a batch of 6 s on one greenlet, then
    receives three plain 8 s tasks: the first takes its other greenlet, the second blocks
    its consumer for the rest of the batch. Its ticks must still renew the batch's run
    (a 3 s lease here), or the run lapses and worker B, which holds calls of the batch
    and frees its greenlets meanwhile, claims them again: the calls would run twice.
    Judged by the observer: one run of the batch, every call once."""
    from tests.apps.batching import longer_run, occupy
    from tests.batching.test_batching import APP as BATCHING

    env = {"BATCH_LEASE_TTL": "3"}
    a = workers.start(BATCHING, pool="gevent", concurrency=2, queues="qa", env=env)
    workers.start(BATCHING, pool="gevent", concurrency=2, queues="qb", env=env)
    for _ in range(2):  # B's greenlets busy: A claims the batch
        occupy.apply_async((4,), queue="qb")
    observer.starts_of("occupy", 2)
    results = [
        longer_run.apply_async(kwargs={"account": "x", "doc": d}, queue=["qa", "qb"][d % 2])
        for d in range(5)
    ]
    observer.starts_of("longer_run:x")
    for _ in range(3):  # A's other greenlet, then its consumer, busy
        occupy.apply_async((8,), queue="qa")
    assert [r.get(timeout=60) for r in results] == list(range(5))
    runs = settle(observer, "longer_run", 5, timeout=30)
    assert_each_call_once(runs, [r.id for r in results])
    assert len(runs) == 1, f"the batch ran {len(runs)} times"
    # What was meant happened: A ran the batch, and its pool was full while it ran (A's
    # second plain task started only once the batch's greenlet freed), longer than the
    # run's lease.
    (batch,) = runs
    assert batch.pid == a.pid, "B ran the batch: nothing was tested"
    on_a = sorted(r.start for r in observer.runs_of("occupy", 4, timeout=30) if r.pid == a.pid)
    assert len(on_a) >= 2 and on_a[1] >= batch.end - 200_000, (on_a, batch)
    assert batch.end - batch.start > 3_000_000
