"""The test infrastructure itself: servers, workers and the observer, end to end."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tests.support.observer import Observer, assert_no_overlap, max_concurrent
from tests.support.servers import StoreServer
from tests.support.workers import Workers


def test_workers_run_observed_tasks_and_survive_kills(
    workers: Workers, observer: Observer, store_server: StoreServer, store_url: str
) -> None:
    from tests.apps import basic

    w1 = workers.start(wait=False)
    w2 = workers.start(wait=False)
    w1.wait_ready()
    w2.wait_ready()
    assert len(w1.pool_pids()) == 2

    assert basic.noop.delay().get(timeout=10) is None
    for i in range(20):
        basic.observed.delay(f"k{i % 2}", sleep=0.05)
    runs = observer.wait_for(20, timeout=30)
    assert len(runs) == 20
    assert {r.key for r in runs} == {"k0", "k1"}
    assert {r.pid for r in runs} <= {*w1.pool_pids(), *w2.pool_pids()}
    assert all(r.end - r.start >= 50_000 for r in runs)  # microseconds
    assert max_concurrent(runs) <= 4  # 2 workers x 2 children
    assert len(observer.started()) == 20

    # Kill the worker running a long task: its start stays visible, it never finishes,
    # its pool children die with it, and the other worker works on.
    basic.observed.delay("doomed", sleep=60)
    pid = _wait_for_start(observer, "doomed")
    doomed, survivor = (w1, w2) if pid in w1.pool_pids() else (w2, w1)
    children = doomed.pool_pids()
    doomed.kill()
    assert not doomed.is_running
    assert doomed.returncode == -signal.SIGKILL
    assert not any(_running(child) for child in children)  # (a zombie waits for its reaper)
    assert observer.running("doomed") == 1
    assert "doomed" not in {r.key for r in observer.runs()}
    assert survivor.is_running
    assert basic.noop.delay().get(timeout=10) is None

    # The store keeps its data over a clean restart and a crash.
    with store_server.client() as r:
        r.set("survives", "yes")
    store_server.restart()
    with store_server.client() as r:
        assert r.get("survives") == "yes"
        r.set("survives-crash", "yes")
    store_server.restart(kill=True, down_for=0.2)
    with redis.Redis.from_url(store_url, decode_responses=True) as r:
        assert r.get("survives-crash") == "yes"


def _wait_for_start(observer: Observer, key: str, timeout: float = 10) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for entry in observer.started():
            if entry["key"] == key:
                return int(entry["pid"])
        time.sleep(0.05)
    raise AssertionError(f"no run of {key!r} started within {timeout} s")


def test_a_single_key_run_serially_does_not_overlap(workers: Workers, observer: Observer) -> None:
    from tests.apps import basic

    workers.start(concurrency=1)
    for _ in range(5):
        basic.observed.delay("solo", sleep=0.02)
    runs = observer.wait_for(5, timeout=20)
    assert_no_overlap(runs)
    assert observer.max_running("solo") == 1
    assert observer.running("solo") == 0


def test_store_server_pause_and_fixture_recovery(store_server: StoreServer) -> None:
    store_server.pause()
    with (
        redis.Redis(port=store_server.port, socket_timeout=0.3, retry=Retry(NoBackoff(), 0)) as r,
        pytest.raises(redis.TimeoutError),
    ):
        r.ping()
    store_server.resume()
    with store_server.client() as r:
        assert r.ping()
    # Leave it down: the next test's store_url fixture must bring it back.
    store_server.kill()
    assert not store_server.is_running


def test_store_url_brings_the_server_back(store_server: StoreServer, store_url: str) -> None:
    assert store_server.is_running
    with redis.Redis.from_url(store_url, decode_responses=True) as r:
        # Emptied, and not declared new (no store epoch): as a deployment's store.
        assert set(r.keys("*")) == set()


def test_observer_records_a_run_that_raises(observer: Observer) -> None:
    with pytest.raises(RuntimeError), observer.track("k", 7, task_id="t1"):
        raise RuntimeError("boom")
    (finished,) = observer.runs()
    assert (finished.key, finished.fence, finished.task_id) == ("k", 7, "t1")
    assert finished.pid == os.getpid()
    assert finished.start <= finished.end
    assert observer.running("k") == 0
    assert observer.max_running("k") == 1


def test_rabbitmq_url_is_a_url_or_a_skip(rabbitmq_url: str) -> None:
    assert rabbitmq_url.startswith("amqp://")


def test_beat_starts_and_stops(workers: Workers) -> None:
    beat = workers.start_beat("tests.apps.basic")
    assert beat.is_running
    # Let it finish starting: a SIGTERM in the middle of its imports exits with 1.
    time.sleep(1.5)
    assert beat.stop() == 0
    assert "beat: Starting..." in beat.log_text()


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
