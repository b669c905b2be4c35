"""Every worker takes its messages from a Redis broker several at a time when a backlog
waits (worker/transport/intake_together.py): kombu takes one per ``BRPOP`` and records
each unacked in a ``MULTI ZADD HSET EXEC`` of its own, two round trips per message on
the consumer's one thread, the bound of a drain of short tasks (docs/benchmarks.md).

Judged from outside on every pool, a worker as Celery runs it (its default prefetch, an
``exclusive`` task that asks the store at each start): ``MONITOR`` on the broker counts
the round trips spent taking the messages in; every call runs exactly once, and no
message is left unacked or queued.
"""

from __future__ import annotations

import importlib
import time

import pytest

from tests.support.monitor import intake_round_trips, monitored
from tests.support.observer import Observer
from tests.support.pools import ALL_POOLS, pool_setting
from tests.support.servers import STORE_EPOCH, StoreServer
from tests.support.waiting import broadcast, wait_until
from tests.support.workers import Workers

APP = "tests.apps.exclusive"
CALLS = 200


@pytest.mark.timeout(240)
@pytest.mark.parametrize("pool", ALL_POOLS)
def test_a_backlog_is_taken_in_several_per_round_trip_and_each_call_runs_once(
    workers: Workers, observer: Observer, broker_server: StoreServer, pool: str
) -> None:
    _drain_a_backlog(workers, observer, broker_server, pool, APP)


@pytest.mark.timeout(240)
def test_a_backlog_on_a_broker_whose_keys_carry_a_prefix_is_taken_the_same_way(
    workers: Workers, observer: Observer, broker_server: StoreServer, app_environ: None
) -> None:
    """kombu's ``global_keyprefix`` (a Redis broker shared by several apps): the intake
    script was given the list's name as kombu's prefixing client spells bytes
    (``app1:b'celery'``) and the unacked index and hash without the prefix: it took
    nothing, and its calls came on top of kombu's own intake (458 round trips for 200
    calls, against kombu's 400). Every key written carries the prefix."""
    _drain_a_backlog(workers, observer, broker_server, "prefork", "tests.apps.keyprefix")


def _drain_a_backlog(
    workers: Workers, observer: Observer, broker_server: StoreServer, pool: str, app: str
) -> None:
    """A backlog of CALLS exclusive calls drained by one worker of ``app`` (its module's
    ``PREFIX``: kombu's ``global_keyprefix``, if any)."""
    module = importlib.import_module(app)
    ex_skip, prefix = module.ex_skip, getattr(module, "PREFIX", "")
    name, extra, env = pool_setting(pool)
    workers.start(
        app,
        pool=name,
        concurrency=1 if name == "solo" else 2,
        prefetch_multiplier=4,  # Celery's default (the test app sets 1)
        queues="not-yet",
        extra_args=extra,
        env=env,
    )
    # Past the store's grace (a store new to the workers holds leases for a while), so
    # that the drain below is the intake's alone: one call on the queue it consumes.
    assert isinstance(ex_skip.apply_async(("warm",), queue="not-yet").get(timeout=60), int)
    results = [ex_skip.delay(f"k{n}") for n in range(CALLS)]
    with monitored(broker_server) as commands:
        replies = broadcast(
            ex_skip.app,
            lambda: ex_skip.app.control.add_consumer("celery", reply=True, timeout=10, limit=1),
        )
        assert len(replies) == 1, f"the worker does not consume the task queue: {replies}"
        fences = [r.get(timeout=120) for r in results]
        with broker_server.client() as client:
            wait_until(
                lambda: (
                    client.hlen(prefix + "unacked") == 0 and client.llen(prefix + "celery") == 0
                ),
                timeout=20,
                what="no message left unacked or queued",
            )
            if prefix:
                unprefixed = [
                    k
                    for k in client.keys("*")
                    if not str(k).startswith(prefix) and k != STORE_EPOCH  # (the harness's)
                ]
                assert not unprefixed, f"broker keys written without the prefix: {unprefixed}"
    assert all(isinstance(f, int) for f in fences), "a call was skipped"
    runs = [r for r in observer.runs() if r.key != "warm"]
    ran = sorted(r.task_id for r in runs)
    assert ran == sorted(r.id for r in results), (
        f"{len(ran)} runs for {CALLS} calls ({len(set(ran))} distinct)"
    )
    counts = intake_round_trips(commands)
    spent = sum(counts.values())
    print(f"{pool}: intake round trips for {CALLS} calls: {counts}")
    if pool == "solo":
        # One run at a time in the loop's turn: each BRPOP answers into a window that
        # one run's end freed, with no room for more (seen: 1 script call in 200).
        assert spent <= CALLS * 2 + 10, f"{spent} intake round trips for {CALLS} calls"
        return
    # kombu's intake: two per message (400). Several per round trip: fewer, and the
    # script took some (how many depends on the window's room at each BRPOP answer;
    # seen: prefork 331, threads 305, gevent 90, eventlet 93 round trips).
    assert counts["intake_scripts"] > 0, f"no message taken by the intake script: {counts}"
    assert spent < CALLS * 2, f"{spent} intake round trips for {CALLS} calls: {counts}"


def _disable_prefetch_supported() -> bool:
    from celery.app.defaults import NAMESPACES

    return "disable_prefetch" in NAMESPACES["worker"]


@pytest.mark.timeout(180)
@pytest.mark.skipif(
    not _disable_prefetch_supported(),
    reason="worker_disable_prefetch is Celery 5.6's and later's",
)
def test_a_worker_with_prefetch_disabled_takes_no_more_than_its_pool_runs(
    workers: Workers, broker_server: StoreServer
) -> None:
    """``worker_disable_prefetch`` (Celery 5.6, Redis only): the worker takes a message
    only while fewer requests than its pool's processes are reserved, so that a backlog
    stays in the queue for other workers. Taking several at a time must keep that: judged
    from outside, the messages the broker holds unacknowledged for the worker, sampled
    while it drains a backlog of half-second tasks on its two processes."""
    from tests.apps.run_ends import sleeper

    workers.start(
        "tests.apps.run_ends",
        concurrency=2,
        prefetch_multiplier=4,  # Celery's default: a window of 8 without the setting
        extra_args=["--disable-prefetch"],
        queues="not-yet",
    )
    for _ in range(30):
        sleeper.delay(0.5)
    replies = broadcast(
        sleeper.app,
        lambda: sleeper.app.control.add_consumer("celery", reply=True, timeout=10, limit=1),
    )
    assert len(replies) == 1, f"the worker does not consume the task queue: {replies}"
    held = []
    with broker_server.client() as client:
        deadline = time.monotonic() + 4.0
        while time.monotonic() < deadline:
            held.append(int(client.hlen("unacked")))
            time.sleep(0.02)
    print(f"messages unacked while draining: max {max(held)}, samples {len(held)}")
    # Two running (acked at the start, acks_late off: out of the hash) and at most a few
    # on their way in: never the window of 8 that prefetch would fill.
    assert max(held) <= 3, f"the worker held up to {max(held)} messages (its pool runs 2)"
