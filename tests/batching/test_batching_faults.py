"""Batching by key when things fail, on real workers, judged by the observer (issue 37):
a worker SIGKILLed with calls waiting or mid-run, a pool process killed, the store
restarted empty. Split from test_batching.py so that the suite's processes share the
long files (tests/batching/test_batching.py has the helpers)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.batching.test_batching import (
    APP,
    assert_each_call_once,
    runs_of,
    settle,
)
from tests.support.observer import Observer
from tests.support.servers import StoreServer
from tests.support.waiting import wait_until
from tests.support.workers import Workers


def test_a_worker_killed_with_calls_waiting_loses_none_and_runs_none_twice(
    workers: Workers, observer: Observer
) -> None:
    from tests.apps.batching import slow_fill

    env = {"BATCH_VISIBILITY": "5"}
    pool = [workers.start(APP, concurrency=2, env=env, wait=False) for _ in range(3)]
    for w in pool:
        w.wait_ready()
    results = {}
    for d in range(30):
        result = slow_fill.apply_async(kwargs={"account": "k", "doc": d})
        results[result.id] = (result, d)
    time.sleep(0.8)  # received and registered; the batch is 2 s away
    pool[0].kill()
    runs = settle(observer, "slow_fill", 30, timeout=90)
    time.sleep(8)  # the killed worker's messages come back (visibility 5 s) and are acked
    runs = runs_of(observer, "slow_fill")
    assert_each_call_once(runs, list(results))
    for result, doc in results.values():
        assert result.get(timeout=30) == doc * 2


def test_a_worker_killed_mid_run_with_acks_late_runs_its_batch_again_once(
    workers: Workers, observer: Observer
) -> None:
    from tests.apps.batching import long_run

    env = {"BATCH_VISIBILITY": "5", "BATCH_ACKS_LATE": "1"}
    pool = [workers.start(APP, concurrency=2, env=env, wait=False) for _ in range(2)]
    for w in pool:
        w.wait_ready()
    results = {}
    for d in range(5):
        result = long_run.apply_async(kwargs={"account": "m", "doc": d})
        results[result.id] = (result, d)
    (first,) = observer.starts_of("long_run:m", 1, timeout=30)
    (runner,) = [w for w in pool if first["pid"] in w.pool_pids()]
    runner.kill()  # mid-run: 3 s long
    runs = settle(observer, "long_run", 5, timeout=90)
    assert_each_call_once(runs, list(results))
    for result, doc in results.values():
        assert result.get(timeout=30) == doc
    assert not any(r.start == first["start"] for r in runs), "the killed run never ended"


def test_calls_waiting_when_the_store_restarts_empty_run_once(
    workers: Workers, observer: Observer
) -> None:
    from tests.apps.batching import slow_fill

    server = StoreServer(name="batch-forgetful", persistent=False)
    server.start()
    try:
        env = {"BATON_URL": server.url(0)}
        pool = [workers.start(APP, concurrency=2, env=env, wait=False) for _ in range(2)]
        for w in pool:
            w.wait_ready()
        results = {}
        for d in range(20):
            result = slow_fill.apply_async(kwargs={"account": "r", "doc": d})
            results[result.id] = (result, d)
        time.sleep(0.5)  # registered; their batch is 1.5 s away
        server.restart(kill=True, down_for=1.0)  # back empty: every call forgotten
        runs = settle(observer, "slow_fill", 20, timeout=60)
        assert_each_call_once(runs, list(results))
        for result, doc in results.values():
            assert result.get(timeout=30) == doc * 2
    finally:
        server.close()


def test_a_batch_running_when_the_store_restarts_empty_runs_once(
    workers: Workers, observer: Observer
) -> None:
    from tests.apps.batching import longer_run

    server = StoreServer(name="batch-forgets-run", persistent=False)
    server.start()
    try:
        # A run ttl of 3 s: the run (6 s) outlasts the grace a restarted store gives
        # (its start + 3 s), so only the runner writing its run back keeps it single.
        env = {"BATON_URL": server.url(0), "BATCH_LEASE_TTL": "3"}
        pool = [workers.start(APP, concurrency=2, env=env, wait=False) for _ in range(3)]
        for w in pool:
            w.wait_ready()
        results = {}
        for d in range(5):
            result = longer_run.apply_async(kwargs={"account": "f", "doc": d})
            results[result.id] = (result, d)
        observer.starts_of("longer_run:f", 1, timeout=30)  # after the new server's grace
        time.sleep(0.5)
        server.restart(kill=True, down_for=0.5)  # back empty, the batch still running
        runs = settle(observer, "longer_run", 5, timeout=60)
        time.sleep(4)  # past the grace: a second run of the same calls would come by now
        runs = runs_of(observer, "longer_run")
        assert len(observer.started()) == len(runs), "no run started beside the first"
        assert_each_call_once(runs, list(results))
        for result, doc in results.values():
            assert result.get(timeout=30) == doc
    finally:
        server.close()


def test_a_pool_process_killed_mid_run_fails_its_carrier_and_the_others_run_again(
    workers: Workers, observer: Observer
) -> None:
    from celery.exceptions import WorkerLostError

    from tests.apps.batching import long_run

    workers.start(APP, concurrency=2)
    results = {}
    for d in range(5):
        result = long_run.apply_async(kwargs={"account": "p", "doc": d})
        results[result.id] = (result, d)
    (first,) = observer.starts_of("long_run:p", 1, timeout=30)
    os.kill(first["pid"], signal.SIGKILL)  # the pool process running the batch
    lost = []
    for call_id, (result, doc) in results.items():
        try:
            assert result.get(timeout=60) == doc
        except WorkerLostError:
            lost.append(call_id)
    assert len(lost) == 1, "the carrier fails as Celery fails a task whose process died"
    runs = settle(observer, "long_run", 4)
    assert_each_call_once(runs, [i for i in results if i not in lost])


@pytest.mark.timeout(180)
def test_calls_given_again_by_the_broker_while_they_wait_survive_their_holder(
    workers: Workers, observer: Observer
) -> None:
    """The Redis broker gives a held call's message again once its visibility timeout
    passed (3 s here; the batch waits 8 s), to the same worker: the same message, with
    the same delivery tag. Found by the nemesis soak (seed 682791223): the holder acked
    the older copy of the call it held twice, which removed the broker's unacked record
    of the newer; killed before the batch ran, it left nothing for the broker to give
    again, and the calls never ran. Now every call runs once, on the next worker."""
    from tests.apps.batching import patient

    env = {"BATCH_VISIBILITY": "3"}
    holder = workers.start(APP, concurrency=2, env=env)
    results = {}
    for d in range(5):
        result = patient.apply_async(kwargs={"account": "v", "doc": d})
        results[result.id] = (result, d)
    wait_until(
        lambda: holder.log_text().count("batching.patient[") >= 10,
        30,
        "every call received twice by its holder (the broker gave it again)",
    )
    holder.kill()  # before its batch's 8 s
    workers.start(APP, concurrency=2, env=env)
    for result, doc in results.values():
        assert result.get(timeout=60) == doc
    runs = settle(observer, "patient", 5, timeout=30)
    assert_each_call_once(runs, list(results))


@pytest.mark.timeout(120)
def test_calls_waiting_when_the_broker_restarts_run_once_without_waiting_its_timeout(
    workers: Workers, observer: Observer, broker_server: StoreServer
) -> None:
    """A worker holds batched calls (their batch 8 s away) when its Redis broker is
    SIGKILLed and restarted (its data kept). Their messages are unacknowledged: kombu
    cannot restore them as the connection goes (the broker is away), and would give
    them back only after the broker's visibility timeout (an hour by default, the
    default here). The worker takes them back at the reconnect, as it does its other
    held requests (worker/transport/held_return.py), and each runs once."""
    from tests.apps.batching import patient

    worker = workers.start(APP, concurrency=2)
    results = [patient.apply_async(kwargs={"account": "k", "doc": d}) for d in range(6)]
    wait_until(
        lambda: worker.log_text().count("tests.apps.batching.patient[") >= 6,
        20,
        "the calls received and held",
    )
    broker_server.restart(kill=True, down_for=1.0)
    runs = settle(observer, "patient", 6, timeout=60)
    assert_each_call_once(runs, [r.id for r in results])
    for doc, result in enumerate(results):
        assert result.get(timeout=30) == doc
