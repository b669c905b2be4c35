"""Threads, gevent and eventlet: a rate grant is not started late by what happens
between the hand-over and the body (eventlet: 3 starts in 24 ms at 2/s before it was
judged on its greenlet too).

Issue 34 (a). On the gevent pool the body starts on a greenlet of the main process,
after Celery's accept: ``Request.on_accepted`` acknowledges the message there
(``acks_late=False``; without an event loop ``Consumer.call_soon_ack`` runs it at
once), a broker call. While the broker does not answer (paused here; in a deployment a
slow or failing-over broker), each granted request waits in that call, and the worker
grants the next one to the next free greenlet, which waits too; when the broker
answered, their bodies started at once, and together with the grants that follow
(three starts in 36 ms at 2/s). The main process judged each grant fresh when it handed
it over; the greenlet now judges it again before the body (worker/pool/in_process.py).
On the threads pool the event loop acknowledges the message (the same pause held
nothing up there, before and after): kept here as the control.

Real workers; the bodies stamp their starts on the store server's clock (an observer
in a database of its own there: the broker is the server paused).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.limits.test_rate_limits import assert_gcra_bound
from tests.support.observer import Observer
from tests.support.pools import EVENTLET
from tests.support.servers import StoreServer
from tests.support.workers import Workers

#: Admission to the body's first line on a loaded 2-core machine (as in test_at_start).
START_JITTER_US = 250_000
#: The observer's database on the store server (emptied with the store by ``store_url``).
OBSERVER_DB = 3


def acks_on_the_greenlet() -> bool:
    """Whether gevent's accept acknowledges the message on the body's greenlet (Celery
    5.7: ``Consumer.call_soon_ack``); before, the worker's own loop did, later."""
    from celery.worker.consumer.consumer import Consumer

    return hasattr(Consumer, "call_soon_ack")


def _busy_pool_worker(
    workers: Workers, store_server: StoreServer, pool: str, concurrency: int
) -> Any:
    """A worker of tests/apps/busy_pool.py whose bodies stamp their starts on the store
    server (not paused with the broker)."""
    return workers.start(
        "tests.apps.busy_pool",
        pool=pool,
        concurrency=concurrency,
        env={"TEST_OBSERVER_URL": store_server.url(OBSERVER_DB)},
    )


@pytest.fixture
def store_observer(store_server: StoreServer, store_url: str) -> Iterator[Observer]:
    """An Observer on the store server: its clock, and not paused with the broker."""
    obs = Observer(store_server.url(OBSERVER_DB))
    yield obs
    obs.close()


@pytest.mark.parametrize("pool", ["threads", "gevent", EVENTLET])
def test_rate_grants_held_up_before_the_body_do_not_start_together(
    workers: Workers,
    store_observer: Observer,
    broker_server: StoreServer,
    store_server: StoreServer,
    broker_url: str,
    pool: str,
) -> None:
    """2/s on one worker of 2 threads (greenlets); the broker stops answering twice for
    2 s while the rate paces its backlog. Every start keeps to the rate."""
    from tests.apps import busy_pool

    worker = _busy_pool_worker(workers, store_server, pool, concurrency=2)
    count = 12
    for n in range(count):
        busy_pool.rated.delay(n)
    store_observer.starts_of("rated", 2, timeout=30)  # paced now
    for _ in range(2):
        time.sleep(0.7)
        broker_server.pause()
        try:
            time.sleep(2.0)
        finally:
            broker_server.resume()
    store_observer.wait_for(count, timeout=60)
    starts = [s["start"] for s in store_observer.started() if s["key"] == "rated"]
    assert len(starts) == count
    assert_gcra_bound(starts, 2.0, burst=1, tolerance_us=START_JITTER_US)
    if pool == "gevent" and acks_on_the_greenlet():  # judged on the greenlet
        assert "after its rate grant" in worker.log_text()


def test_a_throttled_run_held_up_before_the_body_keeps_its_window(
    workers: Workers,
    store_observer: Observer,
    broker_server: StoreServer,
    store_server: StoreServer,
    broker_url: str,
) -> None:
    """``throttle=2.0`` (trailing) on gevent worker A: a trailing run comes due while the
    broker does not answer, so its greenlet waits in Celery's accept; worker B gets the
    next delivery as the broker answers again. Every two starts are a window apart."""
    from tests.apps import busy_pool

    env = {"TEST_OBSERVER_URL": store_server.url(OBSERVER_DB)}
    a = workers.start("tests.apps.busy_pool", pool="gevent", concurrency=2, queues="a", env=env)
    workers.start("tests.apps.busy_pool", concurrency=1, queues="b", env=env)
    window = busy_pool.THROTTLE
    busy_pool.throttled.apply_async((0,), queue="a")  # runs, and opens a window
    store_observer.starts_of("throttled", 1, timeout=30)
    opened = time.monotonic()
    busy_pool.throttled.apply_async((1,), queue="a")  # held: due when the window ends
    time.sleep(max(0.0, opened + window - 0.5 - time.monotonic()))
    broker_server.pause()
    try:
        time.sleep(2.5)  # the trailing run came due meanwhile, and waits in the accept
    finally:
        broker_server.resume()
    busy_pool.throttled.apply_async((2,), queue="b")
    time.sleep(window + 2.0)  # a run moved to the next window starts by then
    starts = sorted(s["start"] for s in store_observer.started() if s["key"] == "throttled")
    assert len(starts) >= 2, starts
    close = [
        round((after - before) / 1e6, 2)
        for before, after in itertools.pairwise(starts)
        if after - before < window * 1_000_000 - START_JITTER_US
    ]
    assert not close, f"two starts of one throttle key closer than its {window:g} s window: {close}"
    if acks_on_the_greenlet():
        assert "after its throttle window opened" in a.log_text()


@pytest.mark.parametrize("pool", ["threads", "gevent", EVENTLET])
def test_runs_going_on_across_a_lost_broker_connection_keep_their_pool_slots(
    workers: Workers,
    store_observer: Observer,
    broker_server: StoreServer,
    store_server: StoreServer,
    broker_url: str,
    pool: str,
) -> None:
    """One thread (greenlet) runs plain work when the broker connection is lost. Celery
    before 5.7 forgets every request it holds then, running ones included
    (``Consumer.on_close`` empties ``reserved_requests``); counted by those, the pool
    looked free, and rate grants went to a pool whose only thread was busy: they waited
    behind the plain work and started together when it ended (Celery 5.6.3, threads: 3
    starts in 529 ms at 2/s; gevent: 3 in a second). Now the pool slots count running
    requests too, and a grant that still came late would be judged on its thread or
    greenlet. 2/s at every start."""
    from tests.apps import busy_pool
    from tests.support.waiting import wait_until

    worker = _busy_pool_worker(workers, store_server, pool, concurrency=1)
    busy_pool.occupy.delay(6.0)
    store_observer.starts_of("occupy", 1, timeout=30)
    broker_server.restart(down_for=0.5)
    wait_until(
        lambda: worker.log_text().count("Connected to redis://") >= 2,
        60,
        "the worker reconnects to the broker",
    )
    count = 4
    for n in range(count):
        busy_pool.rated.delay(n)
    store_observer.wait_for(1 + count, timeout=60)
    starts = [s["start"] for s in store_observer.started() if s["key"] == "rated"]
    assert len(starts) == count
    assert_gcra_bound(starts, 2.0, burst=1, tolerance_us=START_JITTER_US)


@pytest.mark.parametrize("pool", ["gevent", EVENTLET])
def test_a_call_cancelled_while_its_greenlet_waited_does_not_start(
    workers: Workers,
    store_observer: Observer,
    broker_server: StoreServer,
    store_server: StoreServer,
    broker_url: str,
    pool: str,
) -> None:
    """2/s on one worker of 2 greenlets; the broker stops answering while two granted
    calls wait in their greenlets' accept (its ack), and every call not started yet is
    cancelled then (``baton.cancel``). None of them starts once the broker answers:
    the greenlet asks about a cancel after the accept, before the body (before, the two
    waiting ones started after their cancel)."""
    from tests.apps import busy_pool

    worker = _busy_pool_worker(workers, store_server, pool, concurrency=2)
    sent = [busy_pool.rated.delay(n).id for n in range(10)]
    store_observer.starts_of("rated", 2, timeout=30)  # paced now
    broker_server.pause()
    try:
        time.sleep(1.5)  # two grants handed over meanwhile, their greenlets in the ack
        started = {s["task_id"] for s in store_observer.started() if s["key"] == "rated"}
        cancelled = [task_id for task_id in sent if task_id not in started]
        for task_id in cancelled:
            busy_pool.baton.cancel(task_id)
    finally:
        broker_server.resume()
    time.sleep(4.0)  # a cancelled call that starts anyway would start now
    after = [s["task_id"] for s in store_observer.started() if s["key"] == "rated"]
    assert not set(after) & set(cancelled), "a cancelled call started"
    assert "was cancelled while it waited" in worker.log_text()  # judged on its greenlet
