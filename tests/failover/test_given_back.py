"""A grant given back is never the one a run holds (CI, stop 40: two runs of one key
overlapped on Redis Cluster).

A request asked before its pool slot frees (worker/asking_ahead.py) gives its grant
back when the slot comes past the bound, and asks again at the slot. A release
compares only the owner, and on a store without the pipelined channel (Redis Cluster;
the solo, threads and green pools) releases go out from a background thread while
asks are answered at once: the give-back of the first grant could reach the store
after the second grant to the same owner and free it while its run went on. Judged by
the observer: no two runs of one key overlap, on every store this test runs on.
"""

from __future__ import annotations

import random

import pytest

from tests.support.observer import Observer, assert_fences_increase, assert_no_overlap
from tests.support.workers import Workers


@pytest.mark.timeout(240)
def test_a_grant_given_back_past_the_bound_frees_nothing_a_run_holds(
    prod_workers: Workers, observer: Observer
) -> None:
    """Two workers, 3 processes each, draining short exclusive-wait runs of 12 keys
    whose bodies last 0-30 ms: the pool drains, so requests are asked ahead, and a slot
    often comes just past the bound (the grant given back, asked again at once)."""
    from tests.apps.exclusive import app, ex_wait

    pair = [prod_workers.start("tests.apps.exclusive", concurrency=3, wait=False) for _ in "ab"]
    for worker in pair:
        worker.wait_ready()
    rng = random.Random(7)
    total = 900
    with app.producer_or_acquire() as producer:
        for _ in range(total):
            key = f"key{rng.randrange(12)}"
            ex_wait.apply_async((key, rng.uniform(0.0, 0.03)), producer=producer)

    runs = observer.wait_for(total, timeout=200)

    assert len(runs) == total
    assert_no_overlap(runs)
    assert_fences_increase(runs)
