"""Batching by key across all workers on real workers, judged by the observer (its own
server and clock) and by the results the callers get (issue 37).

The tasks are in tests/apps/batching.py. A "successful run" is one the observer saw end
(its task id field lists the run's call ids).
"""

from __future__ import annotations

import re
import threading
import time
from collections import Counter
from typing import Any

import pytest

from celery_baton.errors import BatchResultError
from tests.support.observer import Observer, Run
from tests.support.servers import StoreServer
from tests.support.sizes import sized
from tests.support.waiting import broadcast, wait_until
from tests.support.workers import Workers

APP = "tests.apps.batching"


def server_time_us(server: StoreServer) -> int:
    with server.client() as client:
        seconds, micros = client.time()
    return int(seconds) * 1_000_000 + int(micros)


def runs_of(observer: Observer, task: str) -> list[Run]:
    return [r for r in observer.runs() if r.key.startswith(f"{task}:")]


def call_ids(run: Run) -> list[str]:
    return run.task_id.split(",")


def settle(observer: Observer, task: str, n_calls: int, timeout: float = 60) -> list[Run]:
    """The runs of ``task`` once they hold ``n_calls`` calls (or the timeout passed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        runs = runs_of(observer, task)
        if sum(len(call_ids(r)) for r in runs) >= n_calls:
            break
        time.sleep(0.2)
    time.sleep(1.0)  # a call run twice would show now
    return runs_of(observer, task)


def assert_each_call_once(runs: list[Run], ids: list[str]) -> None:
    seen = Counter(i for r in runs for i in call_ids(r))
    twice = [i for i, n in seen.items() if n > 1]
    assert not twice, f"{len(twice)} calls ran in two successful runs: {twice[:5]}"
    lost = set(ids) - set(seen)
    assert not lost, f"{len(lost)} calls never ran in a successful run: {sorted(lost)[:5]}"
    assert set(seen) == set(ids)


def start_three(workers: Workers) -> None:
    """Three workers of 2 processes each, started together."""
    for _ in range(3):
        workers.start(APP, concurrency=2, wait=False)
    for w in workers.started:
        w.wait_ready()


def publish_from_two(
    task: Any, keys: int, per_key: int, *, key_stride: int
) -> dict[str, tuple[Any, int]]:
    """Two publishers (threads), each half of every key's calls, interleaved across keys:
    ``{task id: (its AsyncResult, its doc)}``; doc numbers are distinct per call."""
    results: dict[str, tuple[Any, int]] = {}
    lock = threading.Lock()

    def publish(part: int) -> None:
        for n in range(per_key // 2):
            for account in range(keys):
                doc = account * key_stride + part * (key_stride // 2) + n
                result = task.apply_async(kwargs={"account": account, "doc": doc})
                with lock:
                    results[result.id] = (result, doc)

    publishers = [threading.Thread(target=publish, args=(p,)) for p in range(2)]
    for p in publishers:
        p.start()
    for p in publishers:
        p.join()
    return results


def test_calls_from_two_publishers_run_in_batches_of_one_key_across_three_workers(
    workers: Workers, observer: Observer
) -> None:
    from tests.apps.batching import index

    start_three(workers)
    keys, per_key = 4, 60
    results = publish_from_two(index, keys, per_key, key_stride=1000)
    runs = settle(observer, "index", keys * per_key)

    assert all("|" not in r.key for r in runs), "a run held calls of two keys"
    assert_each_call_once(runs, list(results))
    for result, doc in results.values():
        assert result.get(timeout=30) == doc * 2, "each caller gets its own call's result"
    pids = {r.pid for r in runs}
    sizes = [len(call_ids(r)) for r in runs]
    assert max(sizes) <= 10
    full = sum(1 for s in sizes if s == 10)
    print(f"runs {len(runs)}, full {full}, sizes {sorted(Counter(sizes).items())}")
    print(f"pool processes that ran batches: {len(pids)}")
    assert len(pids) >= 2, "runs in the pools of several workers"
    # Batches span workers: a run holds calls that several workers received (each
    # worker's log says which task ids it received).
    receiver = {
        call_id: w.hostname
        for w in workers.started
        for call_id in re.findall(r"index\[([0-9a-f-]{36})\] received", w.log_text())
    }
    assert set(receiver) == set(results), "every call received once"
    spanning = sum(1 for r in runs if len({receiver[i] for i in call_ids(r)}) > 1)
    print(f"runs holding calls received by several workers: {spanning} of {len(runs)}")
    assert spanning >= 1
    assert all("Traceback" not in w.log_text() for w in workers.started)


def test_a_burst_within_batch_wait_runs_in_full_batches(
    workers: Workers, observer: Observer
) -> None:
    from tests.apps.batching import fill

    # The burst is all in the queue before the workers consume it (published while they
    # consumed, a machine at ten times its cores in load took over the 1 s wait to
    # publish the 90 calls: 12 runs of 6-9 calls, none full).
    for _ in range(2):
        workers.start(APP, concurrency=2, wait=False, queues="not-yet")
    for w in workers.started:
        w.wait_ready()
    results = [fill.apply_async(kwargs={"account": n % 3, "doc": n}) for n in range(90)]
    replies = broadcast(
        fill.app,
        lambda: fill.app.control.add_consumer("celery", reply=True, timeout=10, limit=2),
    )
    assert len(replies) == 2, f"not every worker consumes the task queue: {replies}"
    runs = settle(observer, "fill", 90)
    assert_each_call_once(runs, [r.id for r in results])
    sizes = [len(call_ids(r)) for r in runs]
    print(f"fill: sizes {sorted(Counter(sizes).items())}")
    # 30 calls per key within the 1 s wait: 3 full batches per key.
    assert sizes.count(10) >= len(runs) // 2


def test_a_lone_partial_batch_starts_after_batch_wait(
    workers: Workers, observer: Observer, broker_server: StoreServer
) -> None:
    from tests.apps.batching import index

    workers.start(APP, concurrency=2)
    workers.start(APP, concurrency=2)
    index.apply_async(kwargs={"account": "warm", "doc": 0}).get(timeout=30)
    published = server_time_us(broker_server)
    results = [index.apply_async(kwargs={"account": "lone", "doc": d}) for d in range(3)]
    assert [r.get(timeout=30) for r in results] == [0, 2, 4]
    (run,) = [r for r in runs_of(observer, "index") if r.key == "index:lone"]
    waited = (run.start - published) / 1e6
    print(f"lone batch started {waited:.3f} s after its first publish (batch_wait 0.2)")
    assert sorted(call_ids(run)) == sorted(r.id for r in results)
    assert waited >= 0.15, "a partial batch waits for batch_wait"
    assert waited < 2.0, "a partial batch starts batch_wait after its first call (+ margin)"


def test_a_raising_body_fails_every_call_and_a_mapping_names_each_call(
    workers: Workers, observer: Observer
) -> None:
    from tests.apps.batching import boom, by_id

    workers.start(APP, concurrency=2)
    calls = [boom.apply_async(kwargs={"account": "b", "fail": n == 2}) for n in range(4)]
    for result in calls:
        with pytest.raises(ValueError, match="boom in a batch of 4"):
            result.get(timeout=30)
    mapped = [by_id.apply_async(kwargs={"doc": d}) for d in (1, -1, 3)]
    assert mapped[0].get(timeout=30) == 2
    assert mapped[2].get(timeout=30) == 4
    with pytest.raises(BatchResultError, match=mapped[1].id):
        mapped[1].get(timeout=30)


@pytest.mark.slow
def test_ten_keys_of_300_calls_from_two_publishers_at_batch_size_50(
    workers: Workers, observer: Observer
) -> None:
    """Issue 37's scale: 3 workers, 10 keys x 300 calls from 2 publishers (with
    BATON_FULL=1; 10 x 100 in the default run: 20 batches of 50 and more per key)."""
    from tests.apps.batching import wide

    start_three(workers)
    keys, per_key = 10, sized(100, 300)
    started = time.monotonic()
    results = publish_from_two(wide, keys, per_key, key_stride=10_000)
    published = time.monotonic() - started
    runs = settle(observer, "wide", keys * per_key, timeout=120)
    assert all("|" not in r.key for r in runs), "a run held calls of two keys"
    assert_each_call_once(runs, list(results))
    for result, doc in results.values():
        assert result.get(timeout=60) == doc * 2
    sizes = [len(call_ids(r)) for r in runs]
    span = (max(r.end for r in runs) - min(r.start for r in runs)) / 1e6
    print(
        f"wide: published {len(results)} in {published:.1f} s; {len(runs)} runs, "
        f"{sizes.count(50)} full, sizes {sorted(Counter(sizes).items())}; runs span {span:.1f} s"
    )
    assert max(sizes) <= 50


def test_each_batch_run_is_a_task_event_naming_its_calls(
    workers: Workers, observer: Observer, broker_url: str
) -> None:
    from tests.apps.batching import index
    from tests.support.task_events import EventCapture

    for _ in range(2):
        workers.start(APP, concurrency=2, extra_args=["-E"])
    with EventCapture(broker_url) as events:
        results = [index.apply_async(kwargs={"account": "e", "doc": d}) for d in range(10)]
        assert [r.get(timeout=30) for r in results] == [d * 2 for d in range(10)]
        runs = [r for r in runs_of(observer, "index") if r.key == "index:e"]
        assert_each_call_once(runs, [r.id for r in results])
        for run in runs:  # one, unless a loaded machine split the burst

            def carriers(run: Run = run) -> list[str]:
                return [i for i in call_ids(run) if "task-baton-batch" in events.types(i)]

            wait_until(lambda: len(carriers()) == 1, 20, "the batch's event")
            (carrier,) = carriers()
            event = events.wait_for("task-baton-batch", carrier)
            assert sorted(event["calls"]) == sorted(call_ids(run))
            for call_id in call_ids(run):
                if call_id != carrier:
                    events.wait_for("task-baton-batched", call_id)


def test_batched_calls_in_a_chain_and_a_chord_go_on_as_celery_would(
    workers: Workers, observer: Observer
) -> None:
    from celery import chord

    from tests.apps.batching import add_one, index, total

    workers.start(APP, concurrency=2)
    workers.start(APP, concurrency=2)
    chains = [(index.s(account="ch", doc=d) | add_one.s()).delay() for d in range(4)]
    assert [c.get(timeout=30) for c in chains] == [2 * d + 1 for d in range(4)]
    summed = chord([index.s(account="cd", doc=d) for d in range(6)])(total.s())
    assert summed.get(timeout=30) == sum(2 * d for d in range(6))
    runs = [r for r in runs_of(observer, "index") if r.key in ("index:ch", "index:cd")]
    assert sum(len(call_ids(r)) for r in runs) == 10
    assert any(len(call_ids(r)) > 1 for r in runs), "the calls ran batched"


def test_a_call_cancelled_while_held_never_runs(workers: Workers, observer: Observer) -> None:
    from celery.exceptions import TaskRevokedError

    from tests.apps.batching import baton, slow_fill

    for _ in range(2):
        workers.start(APP, concurrency=2)
    waiting = [slow_fill.apply_async(kwargs={"account": "x", "doc": d}) for d in range(8)]
    keyed = [slow_fill.apply_async(kwargs={"account": "y", "doc": d}) for d in range(4)]
    time.sleep(0.5)  # held and registered; their batches are 1.5 s away
    for result in waiting[:3]:
        baton.cancel(result.id)
    baton.cancel(task=slow_fill, key={"account": "y"})
    for result in waiting[:3] + keyed:
        with pytest.raises(TaskRevokedError):
            result.get(timeout=30)
    assert [r.get(timeout=30) for r in waiting[3:]] == [2 * d for d in range(3, 8)]
    time.sleep(3)  # a later batch would have run them by now
    runs = runs_of(observer, "slow_fill")
    assert_each_call_once(runs, [r.id for r in waiting[3:]])


def test_status_counts_the_calls_a_worker_holds_for_their_batch(
    workers: Workers, observer: Observer
) -> None:
    import json
    import subprocess
    import sys

    from tests.apps.batching import patient
    from tests.support.celery_processes import _process_env
    from tests.support.processes import REPO_ROOT

    worker = workers.start(APP, concurrency=2)
    results = [patient.apply_async(kwargs={"account": "s", "doc": d}) for d in range(5)]

    def batched() -> int:
        done = subprocess.run(
            [sys.executable, "-m", "celery", "-A", APP, "baton", "status", "--json"],
            env=_process_env(workers.env),
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        entries = json.loads(done.stdout)["workers"]
        return sum(w["batched"] for w in entries if w["hostname"] == worker.hostname)

    wait_until(lambda: batched() == 5, 20, "5 calls batched in status")
    assert [r.get(timeout=30) for r in results] == list(range(5))
