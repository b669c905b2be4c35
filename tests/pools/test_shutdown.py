"""A run that ends during the worker's warm shutdown gives its key back at once, on every
pool (judged from the store, right after the worker exited).

NOT FIXED (found while adding the pools, not part of issue 34 §3/§5): on prefork, threads
and solo the key is left until its lease runs out (``lease_ttl``; 0.5-2.7 s of 3 s left
here): the run's release is queued on the pipelined channel after the consumer's loop
stopped turning. gevent and eventlet (no loop: releases sent from a thread) hold.

# assumes: Celery stops the consumer, then waits for the pool's running tasks: their
# ends come after the consumer's loop stopped turning (prefork: from billiard's result
# thread; threads: from the pool's threads), so nothing may wait for that loop then.
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.support.observer import Observer
from tests.support.servers import StoreServer
from tests.support.workers import Workers

APP = "tests.apps.pools"
#: Not strict: on a machine slow enough, the lease runs out before the look.
LEFT_UNTIL_LEASE_TTL = pytest.mark.xfail(
    reason="a release queued on the loop's channel after the loop stopped", strict=False
)


@pytest.mark.parametrize(
    "pool",
    [
        pytest.param("prefork", marks=LEFT_UNTIL_LEASE_TTL),
        pytest.param("threads", marks=LEFT_UNTIL_LEASE_TTL),
        "gevent",
        pytest.param(
            "eventlet",
            marks=pytest.mark.skipif(
                importlib.util.find_spec("eventlet") is None, reason="eventlet is not installed"
            ),
        ),
        pytest.param("solo", marks=LEFT_UNTIL_LEASE_TTL),
    ],
)
def test_a_run_ending_in_a_warm_shutdown_frees_its_key_at_once(
    pool: str, workers: Workers, observer: Observer, store_server: StoreServer
) -> None:
    from tests.apps.pools import STOPPABLE_QUEUE, stoppable

    worker = workers.start(APP, pool=pool, concurrency=2, queues=STOPPABLE_QUEUE)
    stoppable.delay("t", 0, 2.0)
    observer.starts_of("t")
    assert worker.stop(timeout=30) == 0  # SIGTERM: the run goes on to its end
    observer.runs_of("t", 1, timeout=5)  # it ended
    with store_server.client() as client:
        held = {
            str(k): client.pttl(k) for k in client.keys("baton:*:ex:*") if ":label:" not in str(k)
        }
    assert held == {}, f"{pool}: the key outlived the run (ms left: {held})"
