"""A run that ends during the worker's warm shutdown gives its key back at once, on every
pool (judged from the store, right after the worker exited): its exclusive lease has no
holder, and its unique claim is gone.

The exclusive key's hash may outlive the run: it keeps the key's fence (``_fence``) for
``lease_ttl``, so that fences keep growing; it is free when it names no holder
(``o:<owner>`` fields). (An earlier version of this test read the hash's presence as a
held key and marked prefork, threads and solo as failing.)

The unique claim of an ``acks_late`` run is freed once Celery's ack was sent, which waits
on the consumer's loop (``Releasing.after_ack``): in a warm shutdown the loop has
stopped; kombu's hub runs its queued callbacks once as it closes, and what they queued
must still run (before the fix the claim was left for ``unique_ttl``).

# assumes: Celery stops the consumer, then waits for the pool's running tasks: their
# ends come after the consumer's loop stopped turning (prefork: from billiard's result
# thread; threads: from the pool's threads), so nothing may wait for that loop then.
"""

from __future__ import annotations

import pytest

from tests.support.observer import Observer
from tests.support.pools import ALL_POOLS
from tests.support.servers import StoreServer
from tests.support.workers import Workers

APP = "tests.apps.pools"

POOLS = ALL_POOLS


def _held(store_server: StoreServer) -> dict[str, object]:
    """Every exclusive key with a holder, and every unique claim, with its holders."""
    held: dict[str, object] = {}
    with store_server.client() as client:
        for key in client.keys("baton:*:ex:*"):
            if ":label:" in str(key):
                continue
            holders = [f for f in client.hkeys(key) if str(f).startswith("o:")]
            if holders:
                held[str(key)] = (client.pttl(key), holders)
        for key in client.keys("baton:*:uq:*"):
            if ":label:" not in str(key):  # what `status` shows for it, not the claim
                held[str(key)] = (client.pttl(key), client.get(key))
    return held


@pytest.mark.parametrize("pool", POOLS)
@pytest.mark.parametrize("task", ["stoppable", "unique_late"])
def test_a_run_ending_in_a_warm_shutdown_frees_its_key_at_once(
    pool: str, task: str, workers: Workers, observer: Observer, store_server: StoreServer
) -> None:
    from tests.apps import pools

    worker = workers.start(APP, pool=pool, concurrency=2, queues=pools.STOPPABLE_QUEUE)
    getattr(pools, task).delay("t", 0, 2.0)
    observer.starts_of("t")
    assert worker.stop(timeout=30) == 0  # SIGTERM: the run goes on to its end
    observer.runs_of("t", 1, timeout=5)  # it ended
    held = _held(store_server)
    assert held == {}, f"{pool}: held after the run (ms left, holders): {held}"


def test_a_release_the_store_cannot_take_at_shutdown_is_named(
    workers: Workers, observer: Observer, store_server: StoreServer
) -> None:
    """The store stands still (SIGSTOP) while a run ends in a warm shutdown: its release
    cannot be sent, and the worker exits without it. Its key then frees only when its
    lease runs out: the worker says so, naming the key (it said nothing before)."""
    from tests.apps.pools import STOPPABLE_QUEUE, stoppable

    worker = workers.start(APP, pool="prefork", concurrency=2, queues=STOPPABLE_QUEUE)
    stoppable.delay("named", 0, 1.5)
    observer.starts_of("named")
    store_server.pause()
    try:
        assert worker.stop(timeout=60) == 0
    finally:
        store_server.resume()
    log = worker.log_text()
    assert "baton:{tests.apps.pools.stoppable}:ex:" in log.split("Warm shutdown")[-1], (
        worker.log_tail()
    )
    assert "lease_ttl" in log, worker.log_tail()
