"""Batching on every pool: what it assumes of Celery's pool, tested on each.

A batch is carried into the pool by one of its calls' requests, whose process (thread,
greenlet, the main process itself) runs the body with every call and writes each other
call's result (worker/pool/batch_run.py); the holders learn at their next tick that the
calls ran and ack their messages together (worker/transport/acks_together.py). What
that assumes: a pool process, thread or greenlet may write the result backend and the
store; the consumer's timer ticks on every pool (threads and prefork: the event loop;
gevent and eventlet: a green timer; solo: the loop, between runs); a prefork process
recycled by ``--max-tasks-per-child`` carries the next batch as the first did. Judged
from outside: every call once in a successful run (the observer), each caller's own
result, and no message left unacked in the broker.
"""

from __future__ import annotations

import pytest

from tests.batching.test_batching import assert_each_call_once, settle
from tests.support.observer import Observer
from tests.support.pools import POOLS_AND_RECYCLED
from tests.support.servers import StoreServer
from tests.support.waiting import wait_until
from tests.support.workers import Workers

APP = "tests.apps.batching"
CALLS = 30  # three keys of ten: batches of up to 10 (``index``)


@pytest.mark.parametrize("pool", POOLS_AND_RECYCLED)
def test_batches_run_and_ack_on_every_pool(
    workers: Workers, observer: Observer, broker_server: StoreServer, pool: str
) -> None:
    from tests.apps.batching import index

    name, *extra = pool.split()
    workers.start(APP, pool=name, concurrency=2, extra_args=extra)
    workers.start(APP, pool=name, concurrency=2, extra_args=extra)
    results = [
        index.apply_async(kwargs={"account": f"{name}-{n % 3}", "doc": n}) for n in range(CALLS)
    ]
    assert [r.get(timeout=60) for r in results] == [n * 2 for n in range(CALLS)]
    runs = settle(observer, "index", CALLS)
    assert_each_call_once(runs, [r.id for r in results])
    for run in runs:
        assert len({k for k in run.key.split(":", 1)[1].split("|")}) == 1, run.key
    with broker_server.client() as client:
        wait_until(lambda: client.hlen("unacked") == 0, timeout=15, what="every message acked")
    print(f"{pool}: {len(runs)} runs, sizes {sorted(len(r.task_id.split(',')) for r in runs)}")
