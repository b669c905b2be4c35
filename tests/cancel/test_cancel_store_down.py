"""A worker started while the store was down, and cancels made before (issue 38: the
nemesis soak, seed 721855533).

A worker reads the cancels' marker at its start, then every 2 s: until it has read it
once, it does not know whether cancels by id live. It took that as "none": a plain call
delivered in between was admitted unchecked and ran, although its cancel was in the
store, and nothing said so. In the soak a worker restarted after ``kill_worker`` while
the store was being restarted; two plain calls cancelled 2.4 s and 1.7 s earlier were
delivered to it and ran.
"""

from __future__ import annotations

import os
import time

import redis

from tests.support.observer import Observer
from tests.support.servers import StoreServer
from tests.support.workers import Workers

APP = "tests.apps.cancel"


def test_a_worker_that_has_not_read_the_cancels_yet_checks_each_delivery(
    workers: Workers, observer: Observer, store_server: StoreServer, store_url: str
) -> None:
    from tests.apps import cancel

    ids = [f"down-{os.urandom(4).hex()}-{i}" for i in range(5)]
    for task_id in ids:
        cancel.baton.cancel(task_id, ttl=300)
    store_server.stop()
    try:
        # Its first read of the marker fails: connection refused.
        workers.start(APP, concurrency=2)
    finally:
        store_server.start()
    with redis.Redis.from_url(store_url) as r:  # the records were kept (its AOF)
        assert r.exists(*(f"baton:cancel:{{{task_id}}}" for task_id in ids)) == len(ids)
    # Delivered at once, before the worker's next read of the marker (every 2 s).
    started = time.monotonic()
    for i, task_id in enumerate(ids):
        cancel.keyed.apply_async((1, i), task_id=task_id)
    kept = cancel.keyed.delay(2, 99)
    assert kept.get(timeout=30) == 99
    time.sleep(1.0)
    ran = [s["task_id"] for s in observer.started() if s["task_id"] in ids]
    assert not ran, (
        f"{len(ran)} of {len(ids)} cancelled calls ran, delivered "
        f"{time.monotonic() - started:.1f} s after the store came back"
    )
