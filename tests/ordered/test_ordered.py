"""Ordered keys on real workers (issue 38 §1): per key, runs start in publish order, one
at a time, on any worker; other keys run in parallel.

The observer (its own server and clock) records each run's start and end with its task
id; the test knows each call's place in its key's publish order. Nothing here trusts
the library's word.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from tests.support.celery_processes import _process_env
from tests.support.observer import Observer, assert_no_overlap
from tests.support.processes import REPO_ROOT
from tests.support.sizes import full
from tests.support.workers import Workers

APP = "tests.apps.ordered"
#: The issue's done-when at full size (20 keys x 60 calls) with BATON_ORDERED_FULL=1;
#: CI runs 8 x 25.
FULL = full("BATON_ORDERED_FULL")
KEYS, CALLS = (20, 60) if FULL else (8, 25)


def publish(task: Any, keys: Sequence[str], calls: int, sleep: Callable[[int], float]) -> dict:
    """``calls`` calls of each of ``keys``, interleaved; returns task id -> (key, n)."""
    sent: dict[str, tuple[str, int]] = {}
    for n in range(calls):
        for key in keys:
            sent[task.delay(key, n, sleep(n)).id] = (key, n)
    return sent


def inversions(starts: Sequence[dict], sent: dict[str, tuple[str, int]]) -> int:
    """How many times, per key, a run started before an earlier-published call's run
    (its n smaller than one already started). A killed run started again is no
    inversion (the same n twice in a row)."""
    highest: dict[str, int] = {}
    count = 0
    for start in sorted(starts, key=lambda s: s["start"]):
        if start["task_id"] not in sent:
            continue
        key, n = sent[start["task_id"]]
        if n < highest.get(key, -1):
            count += 1
        highest[key] = max(highest.get(key, -1), n)
    return count


def start_workers(workers: Workers, count: int, **kw: Any) -> list:
    started = [workers.start(APP, concurrency=2, wait=False, **kw) for _ in range(count)]
    for worker in started:
        worker.wait_ready()
    return started


def test_exclusive_wait_does_not_keep_publish_order_with_two_workers(
    workers: Workers, observer: Observer
) -> None:
    """The motivating failure: ``exclusive_conflict="wait"`` runs one call of a key at a
    time, but the waiters of a key on two workers start in no given order. Order kept
    by chance in one round is possible (the waiters' retries may happen to line up), so
    up to three rounds are published until one shows an inversion."""
    from tests.apps.ordered import waiting_apply

    start_workers(workers, 2)
    found = 0
    for round_ in range(3):
        keys = [f"w{round_}-{k}" for k in range(4)]
        sent = publish(waiting_apply, keys, 20, lambda n: 0.02)
        runs = observer.wait_for(len(sent) * (round_ + 1), timeout=120)
        mine = [r for r in runs if r.task_id in sent]
        assert {r.task_id for r in mine} == set(sent)
        assert_no_overlap(mine)  # one at a time: that part holds
        found = inversions(observer.started(), sent)
        if found:
            break
    assert found > 0, "publish order kept by chance in three rounds"


@pytest.mark.timeout(400 if FULL else 180)  # ~15 s; ~50 s when kombu lost a message
def test_ordered_keeps_publish_order_per_key_across_three_workers_one_killed(
    workers: Workers, observer: Observer
) -> None:
    """The done-when, slimmed for CI: 3 workers, 8 keys x 25 calls from 2 publishers
    (each key from one), bodies of 5-40 ms, acks_late, one worker SIGKILLed mid-run:
    per key 0 inversions, 0 overlaps, every call run to its end exactly once (a killed
    unfinished run may have started once more; a message the broker transport lost in the
    kill is never received, and its key goes on after the gap bound)."""
    from tests.apps.ordered import ordered_apply

    victim, *_ = start_workers(workers, 3)
    victim.pool_pids_at_start = victim.pool_pids()
    sent: dict[str, tuple[str, int]] = {}
    keys = [f"k{k}" for k in range(KEYS)]

    def publisher(own: list[str]) -> None:
        sent.update(publish(ordered_apply, own, CALLS, lambda n: 0.005 + (n * 7 % 36) / 1000))

    threads = [threading.Thread(target=publisher, args=(keys[i::2],)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    total = len(sent)
    assert total == KEYS * CALLS
    observer.wait_for(total // 3, timeout=120)
    victim.kill()

    # kombu's Redis transport loses a message that BRPOP handed to a worker killed before
    # it recorded it as unacked (a window of a few microseconds): no worker ever received
    # it, no library can run it. Its key's later calls then wait the gap bound (20 s).
    runs = observer.wait_for(total - 1, timeout=300 if FULL else 100)
    lost: set[str] = set()
    if len({r.task_id for r in runs}) < total:
        deadline = time.monotonic() + 30
        while len({r.task_id for r in observer.runs()}) < total and time.monotonic() < deadline:
            time.sleep(0.2)
        missing = set(sent) - {r.task_id for r in observer.runs()}
        logs = "".join(w.log_text() for w in workers.started)
        lost = {task_id for task_id in missing if task_id not in logs}
        assert lost == missing, f"received and never run: {missing - lost}"
    time.sleep(1.0)  # nothing more may come
    runs = observer.runs()

    finished = defaultdict(int)
    for run in runs:
        finished[run.task_id] += 1
    assert set(finished) == set(sent) - lost and len(lost) <= 1
    # A run the kill cut between its body's end (the observer's) and the record of its
    # end (before its result) did not end for the system: it runs again, once.
    killed_pids = set(victim.pool_pids_at_start)
    for task_id in [t for t, count in finished.items() if count > 1]:
        first, *again = sorted((r for r in runs if r.task_id == task_id), key=lambda r: r.start)
        assert first.pid in killed_pids and len(again) == 1, (first, again, killed_pids)
    starts = observer.started()
    assert inversions(starts, sent) == 0
    assert_no_overlap(runs)
    # A start without an end is a run the kill cut, and it was run again to its end.
    ended = {(r.task_id, r.pid, r.start) for r in runs}
    for start in starts:
        if (start["task_id"], start["pid"], start["start"]) not in ended:
            assert start["pid"] in killed_pids and finished[start["task_id"]] == 1, start
    # Every key ran on more than one worker: order held across workers.
    pids_by_key = defaultdict(set)
    for run in runs:
        pids_by_key[run.key].add(run.pid)
    assert sum(len(p) > 1 for p in pids_by_key.values()) >= KEYS // 2


def test_a_call_that_never_comes_holds_its_key_only_for_the_gap_bound(
    workers: Workers, observer: Observer
) -> None:
    """Key ``late``: call 0 goes to a queue no worker reads yet. Its successors run
    after the gap bound, in order, and the skip is logged with the key and the position;
    call 0, delivered after its successors ran, is refused (a TaskSkipped failure), never
    run. Key ``x``: call 0 expires in the broker; the worker that discards it gives up
    its turn then, and its successors do not wait for the bound."""
    from celery_baton.errors import TaskSkipped
    from tests.apps.ordered import ordered_apply

    published = time.time()  # the lines start (their records are made) here
    ordered_apply.apply_async(("x", 0), expires=0.5)
    late = ordered_apply.apply_async(("late", 0), queue="late")
    time.sleep(1.0)
    sent = {ordered_apply.delay(key, n).id: (key, n) for n in (1, 2, 3) for key in ("x", "late")}
    (worker,) = start_workers(workers, 1, env={"ORDERED_GAP": "3"})

    runs = observer.wait_for(6, timeout=60)

    assert {r.task_id for r in runs} == set(sent)
    assert inversions(observer.started(), sent) == 0
    # (same host: the observer's clock is this one's)
    waited = min(r.start for r in runs if sent[r.task_id][0] == "late") / 1e6 - published
    assert waited > 2.5, "the missing call held its key for the gap bound"
    log = worker.log_text()
    assert f'ordered key {{"key":"late"}} of {ordered_apply.name} skipped position 1' in log
    assert f'ordered key {{"key":"x"}} of {ordered_apply.name} skipped' not in log
    # A 3 s bound is below what the app's broker may take to deliver a killed worker's
    # messages again (2 x 4 s + 1 s + 5 s): said at start.
    assert f"{ordered_apply.name} is ordered with ordered_gap_timeout=3s, shorter" in log

    # The operator sees it: `celery baton status` lists the line's skip.
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", APP, "baton", "status", "--json"],
        env=_process_env(workers.env),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    lines = {line["label"]: line for line in json.loads(done.stdout)["ordered"]}
    line = lines["ordered_apply(key='late')"]  # the key in words, as a lease's
    assert line["skipped"] == 1
    assert line["next"] == 5 and line["waiting"] == 0
    assert line["last_skip"].startswith("1-1 ")
    assert lines.get("ordered_apply(key='x')", {}).get("skipped", 0) == 0  # (drained: not listed)

    # The late call arrives after its successors ran: refused, said, not run.
    late_worker = workers.start(APP, concurrency=1, queues="late", env={"ORDERED_GAP": "3"})
    with pytest.raises(TaskSkipped, match="came after its successors ran"):
        late.get(timeout=30, propagate=True)
    assert late.id not in {s["task_id"] for s in observer.started()}
    assert "refused, not run out of order" in late_worker.log_text()


def test_the_gap_bound_of_a_call_published_to_an_idle_key_counts_from_its_publish(
    workers: Workers, observer: Observer
) -> None:
    """Key ``idle``: call 0 runs and ends, and the key stays idle past the gap bound (3 s).
    Then call 1 goes to a queue no worker reads yet and call 2 to the worker's. Call 1's
    position became next when it was published, not when call 0 ended: call 2 waits the
    gap bound from call 1's publish, not from call 0's end. (Found by the nemesis soak,
    seed 3811: a call published 20 s after its key went idle was skipped 11.5 s later
    under a 30 s bound, and refused when it came.)"""
    from tests.apps.ordered import ordered_apply

    start_workers(workers, 1, env={"ORDERED_GAP": "3"})
    ordered_apply.delay("idle", 0).get(timeout=60)
    time.sleep(4.5)  # idle for longer than the gap bound
    published = time.time()
    ordered_apply.apply_async(("idle", 1), queue="late")
    second = ordered_apply.delay("idle", 2)
    assert second.get(timeout=60) == 2

    runs = {r.task_id: r for r in observer.runs()}
    # (same host: the observer's clock is this one's)
    waited = runs[second.id].start / 1e6 - published
    assert waited > 2.5, (
        f"call 2 started {waited:.2f} s after call 1 was published: call 1's position was "
        "skipped before it had been next for the gap bound (3 s)"
    )


def test_a_retry_keeps_its_place_and_the_next_call_waits_for_it(
    workers: Workers, observer: Observer
) -> None:
    """Call 0 retries once, 2 s later; call 1, published right after it and free to run
    on the other worker, starts only once call 0's retry has run to its end."""
    from tests.apps.ordered import ord_retry

    start_workers(workers, 2)
    first = ord_retry.delay("r", 0, 2.0)
    second = ord_retry.delay("r", 1)

    assert second.get(timeout=60) == 1
    assert first.get(timeout=10) == 0
    runs = sorted(observer.runs(), key=lambda r: r.start)
    assert [r.task_id for r in runs] == [first.id, first.id, second.id]
    assert runs[2].start >= runs[1].end
    assert runs[1].start - runs[0].end >= 1_500_000  # the retry's countdown passed


def test_a_chain_of_ordered_calls_runs_in_chain_order_and_eta_is_refused(
    workers: Workers, observer: Observer
) -> None:
    """Each chain member takes its place when the one before it ends (and publishes it):
    the chain runs in its order. A call with a countdown is refused at publish."""
    from celery import chain

    from celery_baton.errors import ConfigError
    from tests.apps.ordered import ordered_apply

    with pytest.raises(ConfigError, match="takes no eta or countdown"):
        ordered_apply.apply_async(("c", 9), countdown=1)
    start_workers(workers, 2)
    result = chain(ordered_apply.si("c", n, 0.02) for n in range(4)).apply_async()

    assert result.get(timeout=30) == 3
    runs = sorted(observer.runs_of("c", 4), key=lambda r: r.start)
    assert [r.task_id for r in runs][-1] == result.id
    assert_no_overlap(runs)


def test_task_replace_puts_the_replacement_at_the_end_of_its_keys_line(
    workers: Workers, observer: Observer
) -> None:
    """The replaced call's turn ends with it; its replacement, a new publish of the same
    key, runs after the calls published before it."""
    from tests.apps.ordered import ord_replaced

    first = ord_replaced.delay("p", 0)
    second = ord_replaced.delay("p", 200)
    start_workers(workers, 2)

    assert second.get(timeout=30) == 200
    assert first.get(timeout=30) == 100
    runs = sorted(observer.runs_of("p", 3), key=lambda r: r.start)
    assert [r.task_id for r in runs] == [first.id, second.id, first.id]
    assert_no_overlap(runs)


def test_a_call_cancelled_while_it_waits_passes_its_turn_at_once(
    workers: Workers, observer: Observer
) -> None:
    """Call 1 is cancelled (``baton.cancel``) while it waits for call 0: it never runs,
    and call 2 starts as soon as call 0 ends, not after the gap bound (20 s)."""
    from tests.apps.ordered import baton, ordered_apply

    start_workers(workers, 1)
    first = ordered_apply.delay("z", 0, 3.0)
    cancelled = ordered_apply.delay("z", 1)
    third = ordered_apply.delay("z", 2)
    observer.starts_of("z")
    baton.cancel(cancelled.id)

    assert third.get(timeout=15) == 2
    runs = sorted(observer.runs_of("z", 2), key=lambda r: r.start)
    assert [r.task_id for r in runs] == [first.id, third.id]
    assert runs[1].start - runs[0].end < 5_000_000  # not the gap bound


def test_a_call_celery_revokes_at_receipt_passes_its_turn_at_once(
    workers: Workers, observer: Observer
) -> None:
    """Call 1 never reaches celery-baton's admission: Celery drops it as it is received,
    revoked (``app.control.revoke`` before it arrived). Its turn passes then, and call 2
    starts as soon as call 0 ends, not after the gap bound (20 s): before, the key
    waited out the bound."""
    from celery.utils import uuid

    from tests.apps.ordered import app, ordered_apply
    from tests.support.waiting import revoke_until_heard

    start_workers(workers, 1)
    first = ordered_apply.delay("r", 0, 3.0)
    observer.starts_of("r")
    dropped_id = uuid()
    revoke_until_heard(app, dropped_id, terminate=False)
    dropped = ordered_apply.apply_async(("r", 1), task_id=dropped_id)
    third = ordered_apply.delay("r", 2)

    assert third.get(timeout=15) == 2
    assert dropped.state == "REVOKED"
    runs = sorted(observer.runs_of("r", 2), key=lambda r: r.start)
    assert [r.task_id for r in runs] == [first.id, third.id]
    assert runs[1].start - runs[0].end < 5_000_000  # not the gap bound
