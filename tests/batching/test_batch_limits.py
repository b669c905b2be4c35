"""A batch run is one start of a ``global_rate_limit`` and one slot of a
``global_concurrency``, across all workers (issue 37), judged at the batch body's start
by the observer (its own server's clock). Tasks in tests/apps/batching.py.

Before, both options were refused at declaration with a batch.
"""

from __future__ import annotations

from tests.batching.test_batching import assert_each_call_once, call_ids, settle
from tests.limits.test_at_start import START_JITTER_US
from tests.limits.test_rate_limits import assert_gcra_bound
from tests.support.observer import Observer, assert_no_overlap
from tests.support.workers import Workers

APP = "tests.apps.batching"
KEYS = 4
PER_KEY = 10


def _two_workers(workers: Workers) -> None:
    """Two workers of 2 processes each: a batch's run could start on any of 4."""
    for _ in range(2):
        workers.start(APP, concurrency=2, wait=False)
    for w in workers.started:
        w.wait_ready()


def _publish(task: object) -> dict[str, tuple[object, int]]:
    sent: dict[str, tuple[object, int]] = {}
    for n in range(PER_KEY):
        for account in range(KEYS):
            doc = account * 100 + n
            result = task.apply_async(kwargs={"account": account, "doc": doc})  # type: ignore[attr-defined]
            sent[result.id] = (result, doc)
    return sent


def test_batch_runs_start_within_a_global_rate_limit(workers: Workers, observer: Observer) -> None:
    from tests.apps.batching import paced_batch

    _two_workers(workers)
    sent = _publish(paced_batch)
    runs = settle(observer, "paced_batch", len(sent), timeout=90)
    assert_each_call_once(runs, list(sent))
    assert len(runs) >= KEYS * PER_KEY // 5  # batches of at most 5
    for result, doc in sent.values():
        assert result.get(timeout=30) == doc * 2  # type: ignore[attr-defined]
    # Judged at the batch body's first line: the hand-over's noise is allowed for (as
    # for a plain task's start), a second run let through early is not.
    assert_gcra_bound([r.start for r in runs], per_second=2.0, tolerance_us=START_JITTER_US)


def test_batch_runs_hold_one_slot_of_a_global_concurrency(
    workers: Workers, observer: Observer
) -> None:
    from tests.apps.batching import single_batch

    _two_workers(workers)
    sent = _publish(single_batch)
    runs = settle(observer, "single_batch", len(sent), timeout=90)
    assert_each_call_once(runs, list(sent))
    assert all(len(call_ids(r)) <= 5 for r in runs)
    for result, doc in sent.values():
        assert result.get(timeout=30) == doc * 2  # type: ignore[attr-defined]
    assert_no_overlap(runs, per_key=False)
