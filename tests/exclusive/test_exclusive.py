"""Exclusive tasks on real workers: no overlap under load, under kills, over long runs.

Issue 2, "What it must prove", items 1-3. Runs are judged by the observer (its own
server and clock), the store is read directly; nothing here trusts the library's word.
"""

from __future__ import annotations

import os
import random
import signal
import time
from typing import Any

import pytest

from tests.support.celery_processes import WorkerProcess
from tests.support.observer import Observer, assert_fences_increase, assert_no_overlap
from tests.support.servers import StoreServer
from tests.support.waiting import wait_until
from tests.support.workers import Workers

APP = "tests.apps.exclusive"


def server_time_us(server: StoreServer) -> int:
    """The observer's clock (the broker server's TIME), in microseconds."""
    with server.client() as client:
        seconds, micros = client.time()
    return int(seconds) * 1_000_000 + int(micros)


def start_pair(workers: Workers, concurrency: int, **kw: Any) -> tuple[WorkerProcess, ...]:
    pair = tuple(workers.start(APP, concurrency=concurrency, wait=False, **kw) for _ in range(2))
    for worker in pair:
        worker.wait_ready()
    return pair


def test_200_runs_over_20_keys_on_two_workers_never_overlap(
    workers: Workers, observer: Observer
) -> None:
    from tests.apps.exclusive import ex_wait

    w1, w2 = start_pair(workers, concurrency=4)
    keys = [f"key{i % 20}" for i in range(200)]
    random.Random(2).shuffle(keys)  # neighbours share keys: many requests must wait
    results = [ex_wait.delay(key, 0.03) for key in keys]

    runs = observer.wait_for(200, timeout=120)

    assert len(runs) == 200
    assert len({r.task_id for r in runs}) == 200
    assert {r.task_id for r in runs} == {res.id for res in results}
    assert {r.key for r in runs} == {f"key{i}" for i in range(20)}
    assert all(r.fence for r in runs)
    assert_no_overlap(runs)
    assert_fences_increase(runs)
    assert all(observer.max_running(f"key{i}") == 1 for i in range(20))
    pids = {r.pid for r in runs}
    assert pids & set(w1.pool_pids()) and pids & set(w2.pool_pids()), "both workers ran tasks"
    # Every task succeeded (none skipped, none failed) and returned the fence it ran with.
    by_id = {r.task_id: r for r in runs}
    for res in results[:20]:
        assert res.get(timeout=10) == by_id[res.id].fence
    assert "held for" in w1.log_text() + w2.log_text()  # waiting really happened


def test_killed_pool_child_releases_its_lease_at_once(
    workers: Workers, observer: Observer, store_server: StoreServer
) -> None:
    """WorkerLostError path: released by the main process, long before lease_ttl (30 s)."""
    from tests.apps.exclusive import ex_wait, exclusive_key, live_owners

    (worker,) = [workers.start(APP, concurrency=2)]
    result = ex_wait.delay("victim", 60)
    (start,) = observer.starts_of("victim")
    key = exclusive_key(ex_wait, "victim")
    with store_server.client() as store:
        owners = live_owners(store, key)
        assert [o.split("|")[0] for o in owners] == [result.id]
        assert list(owners.values()) == [start["fence"]]
        assert start["pid"] in worker.pool_pids()

        os.kill(start["pid"], signal.SIGKILL)
        took = wait_until(lambda: not live_owners(store, key), 10, "lease released")

    assert took < 10  # lease_ttl is 30 s: this was the release, not the expiry
    result.get(timeout=10, propagate=False)
    assert result.state == "FAILURE"
    assert "WorkerLostError" in repr(result.result)
    # The key is free for the next run at once, and its fence is higher.
    again = ex_wait.delay("victim", 0)
    assert again.get(timeout=10) > start["fence"]
    assert worker.is_running


def test_redelivered_after_worker_lost_gets_the_key(
    workers: Workers, observer: Observer, store_server: StoreServer
) -> None:
    """acks_late + reject_on_worker_lost: the redelivered run takes the freed key."""
    from tests.apps.exclusive import ex_late, exclusive_key, live_owners

    workers.start(APP, concurrency=2)
    result = ex_late.delay("late", 1.0)
    (first,) = observer.starts_of("late")
    os.kill(first["pid"], signal.SIGKILL)

    second = observer.starts_of("late", n=2, timeout=30)[1]
    assert second["task_id"] == first["task_id"] == result.id
    assert second["fence"] > first["fence"]
    (run,) = observer.runs_of("late", timeout=20)
    assert (run.task_id, run.fence) == (result.id, second["fence"])
    assert result.get(timeout=10) == second["fence"]
    with store_server.client() as store:
        # The result is stored by the pool child just before the main process releases.
        key = exclusive_key(ex_late, "late")
        wait_until(lambda: live_owners(store, key) == {}, 5, "lease released after the run")


def test_killed_worker_frees_its_keys_within_lease_ttl(
    workers: Workers, observer: Observer, broker_server: StoreServer
) -> None:
    """A whole worker SIGKILLed: nobody releases; its lease (ttl 3 s) runs out."""
    from tests.apps.exclusive import LEASE_TTL, ex_long

    assert LEASE_TTL == 3
    w1, w2 = start_pair(workers, concurrency=2)
    ex_long.delay("orphan", 60)
    (doomed_start,) = observer.starts_of("orphan")
    doomed, survivor = (w1, w2) if doomed_start["pid"] in w1.pool_pids() else (w2, w1)
    doomed.kill()
    killed_at = server_time_us(broker_server)

    result = ex_long.delay("orphan", 0.1)
    (run,) = observer.runs_of("orphan", timeout=30)

    assert run.task_id == result.id
    assert run.pid in survivor.pool_pids()
    assert run.fence is not None and run.fence > doomed_start["fence"]
    waited = (run.start - killed_at) / 1e6
    assert waited < 10 * LEASE_TTL / 3  # within lease_ttl (+ slack), not never
    assert observer.running("orphan") == 1  # the killed run never finished: no overlap claim
    assert "held for" in survivor.log_text()


def test_a_run_three_times_the_lease_ttl_keeps_its_key(
    workers: Workers, observer: Observer, store_server: StoreServer
) -> None:
    """Live workers renew: a 10 s run with lease_ttl 3 s never loses its key."""
    from tests.apps.exclusive import LEASE_TTL, ex_long, exclusive_key, live_owners

    w1, w2 = start_pair(workers, concurrency=2)
    long_result = ex_long.delay("marathon", 3 * LEASE_TTL + 1)
    (start,) = observer.starts_of("marathon")
    duplicate = ex_long.delay("marathon", 0)
    key = exclusive_key(ex_long, "marathon")

    seen: set[tuple[str, int]] = set()
    with store_server.client() as store:
        while not [r for r in observer.runs() if r.key == "marathon"]:
            owners = live_owners(store, key)
            if owners:  # empty only in the instant between the end and the next start
                seen |= set(owners.items())
            assert len(owners) <= 1
            time.sleep(0.25)
    first_owner = {(o, f) for o, f in seen if o.startswith(long_result.id)}
    assert first_owner == {(o, start["fence"]) for o, _ in first_owner}, "fence unchanged"
    assert len(first_owner) == 1

    runs = observer.runs_of("marathon", n=2, timeout=20)
    first, second = sorted(runs, key=lambda r: r.start)
    assert first.task_id == long_result.id and second.task_id == duplicate.id
    assert (first.end - first.start) / 1e6 >= 3 * LEASE_TTL
    assert second.start >= first.end
    assert_no_overlap(runs)
    assert_fences_increase(runs)
    assert first.fence == start["fence"]
    assert "lease lost" not in w1.log_text() + w2.log_text()


def test_a_skipped_duplicate_is_reported(workers: Workers, observer: Observer) -> None:
    """exclusive_conflict="skip": acked, not run, WARNING with key and holder, a result."""
    from celery_baton import TaskSkipped
    from tests.apps.exclusive import ex_skip

    (worker,) = [workers.start(APP, concurrency=2)]
    holder = ex_skip.delay("busy", 3)
    observer.starts_of("busy")
    duplicate = ex_skip.delay("busy", 0)

    with pytest.raises(TaskSkipped) as skipped:
        duplicate.get(timeout=10)
    assert holder.id in str(skipped.value)
    assert duplicate.state == "FAILURE"
    assert holder.get(timeout=10)
    assert [r.task_id for r in observer.runs()] == [holder.id]
    log = worker.log_text()
    assert f"[{duplicate.id}] skipped" in log and holder.id in log
    # One line says why: the short wait for a release in flight is not logged as a hold.
    assert f"[{duplicate.id}] held for" not in log, log[-3000:]


def test_a_duplicate_is_skipped_while_the_pool_is_busy_with_other_work(
    workers: Workers, observer: Observer
) -> None:
    """A "skip" duplicate is held a quarter second for a release in flight, then asked
    again. It used to wait for a free pool process to ask again: with the pool busy with
    other work it asked only after its holder had ended, and ran (a duplicate delivered
    while its key was held, run instead of skipped). A skip needs no process."""
    from celery_baton import TaskSkipped
    from tests.apps.exclusive import ex_skip, ex_wait

    workers.start(APP, concurrency=2)
    holder = ex_skip.delay("busy-pool", 5.0)
    observer.starts_of("busy-pool")
    duplicate = ex_skip.delay("busy-pool", 0)
    # The other process: a backlog longer than the holder's run, queued behind the
    # duplicate's first ask.
    fillers = [ex_wait.delay(f"filler-{i}", 2.5) for i in range(3)]

    with pytest.raises(TaskSkipped):
        duplicate.get(timeout=30)
    assert holder.get(timeout=30)
    assert all(r.get(timeout=60) for r in fillers)
    assert [r.task_id for r in observer.runs() if r.key == "busy-pool"] == [holder.id]


CLIENT = """
import sys
from celery_baton import TaskSkipped
from tests.apps.exclusive import ex_skip

holder = ex_skip.delay("exit", 2)
duplicate = ex_skip.delay("exit", 0)
if sys.argv[1] == "uncaught":
    duplicate.get(timeout=20)
try:
    duplicate.get(timeout=20)
except TaskSkipped:
    print("skipped")
"""


@pytest.mark.parametrize("how", ["caught", "uncaught"])
def test_a_client_that_got_a_skip_exits_without_a_traceback(
    workers: Workers, observer: Observer, how: str
) -> None:
    """Issue 28, item 9: ``.get()`` on a skipped duplicate, then the client exits (the
    holder's result still pending): no ``AsyncResult.__del__`` traceback at exit. (Not
    reproduced with Celery 5.7.0 and redis-py 8.1: a guard, it passed before too.)"""
    import subprocess
    import sys

    workers.start(APP, concurrency=2)
    env = {**os.environ, **workers.env}
    proc = subprocess.run(
        [sys.executable, "-c", CLIENT, how], env=env, capture_output=True, text=True, timeout=60
    )
    assert "__del__" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr
    if how == "caught":
        assert proc.returncode == 0 and proc.stdout.strip() == "skipped", proc.stderr
        assert proc.stderr == "", proc.stderr
    else:  # the script's own traceback, and nothing after it
        assert proc.returncode == 1
        assert proc.stderr.rstrip().splitlines()[-1].startswith("celery_baton.errors.TaskSkipped")
