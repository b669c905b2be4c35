"""Requests celery-baton holds for a limit take no pool process, and Celery's settings
that size things by the requests a worker reserved must not count them as the pool's
work (the promise: waiting costs no pool slot). Celery's own waiting requests (a
``rate_limit``'s, an ETA's) are not reserved while they wait.

* ``worker_disable_prefetch`` (Celery 5.6, Redis only): a message is taken only while
  fewer requests are reserved than the pool has processes. Counted, two held requests
  kept a worker of two idle processes from taking anything else.
* ``--autoscale``: the autoscaler grows the pool to the number of reserved requests.
  Counted, a backlog of held requests kept it at its maximum for work that waits.

One worker ``-c 2`` receives 40 calls of a task limited to 2 starts per second, then 10
plain tasks: the plain ones start at once, not behind the 40; autoscaled, the pool
shrinks back to what runs while the 40 are held.
"""

from __future__ import annotations

import time

import kombu.exceptions
import pytest
import redis

from tests.support.observer import Observer
from tests.support.servers import StoreServer
from tests.support.waiting import wait_until
from tests.support.workers import Workers
from tests.transport.test_held_window import _server_us, _wait_for_starts
from tests.transport.test_intake import _disable_prefetch_supported

APP = "tests.apps.held_window"
PLAIN_WITHIN_S = 3.0


def _plain_tasks_start_beside_held_ones(observer: Observer, held: int) -> None:
    """``held`` calls of a task limited to 2 starts a second, then 10 plain tasks: the
    plain ones start within ``PLAIN_WITHIN_S`` of their publish."""
    from tests.apps import held_window

    for n in range(held):
        held_window.paced.delay(n)
    observer.starts_of("paced", 2, timeout=30)
    time.sleep(1.0)  # the worker holds what it took of the backlog
    published = _server_us(observer)
    for n in range(10):
        held_window.quick.delay(n)
    starts = _wait_for_starts(observer, "quick", 10, timeout=60)
    latest = max(starts) - published
    assert latest < PLAIN_WITHIN_S * 1e6, (
        f"the last plain task started {latest / 1e6:.2f} s after its publish"
    )


@pytest.mark.timeout(180)
@pytest.mark.skipif(
    not _disable_prefetch_supported(), reason="worker_disable_prefetch is Celery 5.6's and later's"
)
@pytest.mark.parametrize("pool", ["prefork", "threads", "prefork-reconnected"])
def test_plain_tasks_start_while_requests_are_held_with_prefetch_disabled(
    pool: str, workers: Workers, observer: Observer, broker_server: StoreServer
) -> None:
    """``-reconnected``: the worker's broker connections cut first; Celery narrows the
    new channel's intake again as its consumer restarts, and so is it left here."""
    worker = workers.start(
        APP, pool=pool.split("-")[0], concurrency=2, extra_args=["--disable-prefetch"]
    )
    if pool.endswith("-reconnected"):
        with broker_server.client(0) as broker:  # the broker keeps its data
            broker.client_kill_filter(_type="normal", skipme=True)
        wait_until(lambda: worker.log_text().count("Connected to redis") >= 2, 30, "a reconnection")
    _plain_tasks_start_beside_held_ones(observer, held=40)


@pytest.mark.timeout(180)
def test_an_autoscaled_pool_shrinks_while_its_requests_are_held(
    workers: Workers, observer: Observer
) -> None:
    """A limited call is judged when a pool process can start it, so a burst of them
    grows the pool as it would for any work; once they are held, the pool shrinks back
    (idle processes leave after ``AUTOSCALE_KEEPALIVE``) though the held backlog stays."""
    from tests.apps import held_window

    worker = workers.start(
        APP, concurrency=4, extra_args=["--autoscale=4,1"], env={"AUTOSCALE_KEEPALIVE": "0.5"}
    )
    for n in range(40):
        held_window.paced.delay(n)
    observer.starts_of("paced", 4, timeout=30)  # held, and running two a second
    wait_until(lambda: len(worker.pool_pids()) <= 2, 15, "the pool to shrink")
    sizes = []
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        sizes.append(len(worker.pool_pids()))
        time.sleep(0.1)
    assert len(observer.starts_of("paced", 1)) < 40, "the backlog ran out: nothing held"
    # Two starts a second of a task that takes no time: one process runs them; the
    # autoscaler may add one as two arrive together.
    assert max(sizes) <= 2, f"the pool grew to {max(sizes)} processes for held requests"


@pytest.mark.timeout(180)
@pytest.mark.skipif(
    not _disable_prefetch_supported(), reason="worker_disable_prefetch is Celery 5.6's and later's"
)
def test_batched_calls_make_full_batches_with_prefetch_disabled(
    workers: Workers, observer: Observer
) -> None:
    """Batched calls wait for their batch without a pool process: a worker of two
    processes with prefetch disabled still takes a burst into full batches (counted as
    the pool's work, it took two calls and ran them alone after the batch's wait)."""
    from tests.apps.batching import fill
    from tests.batching.test_batching import assert_each_call_once, call_ids, settle

    results = [fill.apply_async(kwargs={"account": 0, "doc": n}) for n in range(30)]
    workers.start("tests.apps.batching", concurrency=2, extra_args=["--disable-prefetch"])
    runs = settle(observer, "fill", 30)
    assert_each_call_once(runs, [r.id for r in results])
    sizes = sorted(len(call_ids(r)) for r in runs)
    assert sizes.count(10) >= 2, f"batch sizes {sizes}"


def _eta_limit_supported() -> bool:
    from celery.app.defaults import NAMESPACES

    return "eta_task_limit" in NAMESPACES["worker"]


@pytest.mark.timeout(180)
@pytest.mark.skipif(
    not _eta_limit_supported(), reason="worker_eta_task_limit is Celery 5.5's and later's"
)
def test_plain_tasks_start_while_requests_are_held_under_an_eta_task_limit(
    workers: Workers, observer: Observer
) -> None:
    """``worker_eta_task_limit`` caps how far ETA tasks raise the prefetch count (kombu's
    ``QoS.max_prefetch``). Held requests raise it like ETA tasks: they must not be
    capped by a limit set for ETA tasks (celery-baton bounds them by
    ``baton_hold_max``), or they take the window from the work the worker can run; and
    once they ran, the window is Celery's again (kombu lowers a count without the cap:
    each capped raise shrank it for good)."""
    from tests.apps import held_window

    workers.start(APP, concurrency=2, env={"HELD_ETA_LIMIT": "10"})
    _plain_tasks_start_beside_held_ones(observer, held=24)
    observer.starts_of("paced", 24, timeout=60)

    def prefetch_count() -> object:
        try:
            stats = held_window.app.control.inspect(timeout=5).stats() or {}
        except (OSError, redis.RedisError, kombu.exceptions.OperationalError):
            # This process's pooled broker connection may be one an earlier test of the
            # file cut (the "-reconnected" case kills the broker's clients): asked again.
            return None
        return [s.get("prefetch_count") for s in stats.values()]

    # -c 2 at Celery's multiplier of 4 (the app's setting): a window of 8.
    wait_until(lambda: prefetch_count() == [8], 20, "the prefetch count to be 8 again")
