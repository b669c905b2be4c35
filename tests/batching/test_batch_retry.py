"""``self.retry()`` in a batched body retries every call of its batch (issue 37): each
call is published again under its own task id (its retries counted, its canvas kept),
its state is RETRY meanwhile, and its retry runs in a later batch; a call past
``max_retries`` fails with ``MaxRetriesExceededError``. Judged from the callers'
results and the observer's record of each batch run. Tasks in tests/apps/batching.py.

Before, ``self.retry()`` in a batched body failed every call with a ``BatonError``.
"""

from __future__ import annotations

from collections import Counter

import pytest
from celery.exceptions import MaxRetriesExceededError

from tests.batching.test_batching import call_ids, runs_of
from tests.support.observer import Observer
from tests.support.waiting import wait_until
from tests.support.workers import Workers

APP = "tests.apps.batching"


@pytest.mark.parametrize("name", ["flaky_batch", "flaky_auto_batch"])
def test_a_retry_of_a_batch_retries_every_call_of_it(
    workers: Workers, observer: Observer, name: str
) -> None:
    """``self.retry()`` in the body, or an ``autoretry_for`` error it raises."""
    from tests.apps import batching

    flaky_batch = getattr(batching, name)

    for _ in range(2):
        workers.start(APP, concurrency=2, wait=False)
    for w in workers.started:
        w.wait_ready()
    # One batch of 4 (one key, published together); one call fails its first run.
    results = [
        flaky_batch.apply_async(kwargs={"account": "r", "doc": n, "fail": int(n == 1)})
        for n in range(4)
    ]
    for n, result in enumerate(results):
        assert result.get(timeout=60) == n * 2
    runs = runs_of(observer, name)
    seen = Counter(i for r in runs for i in call_ids(r))
    # Each call ran in the retried batch and once more after: twice, never three times.
    assert {result.id: seen[result.id] for result in results} == {r.id: 2 for r in results}
    assert len(runs) >= 2


@pytest.mark.parametrize(
    ("name", "error"), [("flaky_batch", MaxRetriesExceededError), ("flaky_auto_batch", ValueError)]
)
def test_a_call_past_max_retries_fails(
    workers: Workers, observer: Observer, name: str, error: type[Exception]
) -> None:
    """``self.retry()`` without ``exc``: ``MaxRetriesExceededError``; ``autoretry_for``:
    the error itself, as Celery's own retry raises them."""
    from tests.apps import batching

    flaky_batch = getattr(batching, name)
    workers.start(APP, concurrency=2)
    results = [
        flaky_batch.apply_async(kwargs={"account": "m", "doc": n, "fail": 99}) for n in range(3)
    ]
    for result in results:
        with pytest.raises(error):
            result.get(timeout=60)
    wait_until(
        lambda: sum(len(call_ids(r)) for r in runs_of(observer, name)) >= 9,
        30,
        "three runs of each call",
    )
    seen = Counter(i for r in runs_of(observer, name) for i in call_ids(r))
    # max_retries=2: the first run and two retries.
    assert {r.id: seen[r.id] for r in results} == {r.id: 3 for r in results}
