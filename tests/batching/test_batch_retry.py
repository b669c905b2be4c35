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


def test_self_retry_in_a_batch_retries_every_call_of_it(
    workers: Workers, observer: Observer
) -> None:
    from tests.apps.batching import flaky_batch

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
    runs = runs_of(observer, "flaky_batch")
    seen = Counter(i for r in runs for i in call_ids(r))
    # Each call ran in the retried batch and once more after: twice, never three times.
    assert {result.id: seen[result.id] for result in results} == {r.id: 2 for r in results}
    assert len(runs) >= 2


def test_a_call_past_max_retries_fails_with_max_retries_exceeded(
    workers: Workers, observer: Observer
) -> None:
    from tests.apps.batching import flaky_batch

    workers.start(APP, concurrency=2)
    results = [
        flaky_batch.apply_async(kwargs={"account": "m", "doc": n, "fail": 99}) for n in range(3)
    ]
    for result in results:
        with pytest.raises(MaxRetriesExceededError):
            result.get(timeout=60)
    wait_until(
        lambda: sum(len(call_ids(r)) for r in runs_of(observer, "flaky_batch")) >= 9,
        30,
        "three runs of each call",
    )
    seen = Counter(i for r in runs_of(observer, "flaky_batch") for i in call_ids(r))
    # max_retries=2: the first run and two retries.
    assert {r.id: seen[r.id] for r in results} == {r.id: 3 for r in results}
