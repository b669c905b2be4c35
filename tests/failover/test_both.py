"""Exclusive tasks, a global rate limit and beat HA on Redis Cluster AND on Sentinel.

Each test runs twice (``prod_store`` is parametrised): real workers and beats whose
``BATON_URL`` is ``redis+cluster://...`` or ``sentinel://.../baton/0``; the broker and
the observer stay on the ordinary broker server. Runs are judged by the observer.
"""

from __future__ import annotations

import random
import time

import pytest

from tests.beat.helpers import (
    assert_outbox_holds_only_unsent_tail,
    beat_env,
    start_two_beats,
    wait_for_leader,
    wait_for_slots,
)
from tests.beat.test_processes import assert_each_slot_once, drain
from tests.failover.conftest import ProdStore
from tests.limits.test_rate_limits import admissions, assert_gcra_bound, publish, start_workers
from tests.support.observer import Observer, assert_fences_increase, assert_no_overlap
from tests.support.waiting import wait_until
from tests.support.workers import Workers


def test_exclusive_wait_and_skip_never_overlap(prod_workers: Workers, observer: Observer) -> None:
    from tests.apps.exclusive import ex_skip, ex_wait

    pair = [prod_workers.start("tests.apps.exclusive", concurrency=3, wait=False) for _ in "ab"]
    for worker in pair:
        worker.wait_ready()
    keys = [f"key{i % 6}" for i in range(60)]
    random.Random(3).shuffle(keys)
    waited = [ex_wait.delay(key, 0.05) for key in keys]
    skipped = [ex_skip.delay(f"skip{i % 2}", 0.5) for i in range(6)]

    observer.wait_for(60, timeout=60)
    # The skip runs are 0.5 s: every call answered (run or skipped) and every run ended.
    wait_until(
        lambda: (
            all(result.ready() for result in waited + skipped)
            and len(observer.runs()) == len(observer.started())
        ),
        15,
        "every call answered and every started run ended",
    )
    runs = observer.runs()

    waited_runs = [r for r in runs if r.key.startswith("key")]
    assert {r.task_id for r in waited_runs} == {res.id for res in waited}
    assert_no_overlap(runs)
    assert_fences_increase(runs)
    # Skip: at least one of each key ran, and the runs that did never overlapped.
    skip_runs = [r for r in runs if r.key.startswith("skip")]
    assert {r.key for r in skip_runs} == {"skip0", "skip1"}
    assert len(skip_runs) <= len(skipped)
    assert all(observer.max_running(f"key{i}") == 1 for i in range(6))


def test_global_rate_limit(prod_workers: Workers, observer: Observer) -> None:
    from tests.apps import limits

    start_workers(prod_workers, 2)
    publish(limits.rated, 60, numbered=True)

    runs = observer.wait_for(60, timeout=40)

    assert len(runs) == len(observer.started()) == 60
    assert_gcra_bound(admissions(runs), 20)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_beats_leader_killed_each_slot_once(
    prod_workers: Workers, observer: Observer, prod_store: ProdStore
) -> None:
    env = beat_env(
        {"every1": {"every": 1, "options": {"baton_misfire": "all"}}}
    )  # each slot, caught up
    prod_workers.start("tests.apps.beat_app", env=env, concurrency=2)
    beats = start_two_beats(prod_workers, env)
    with prod_store.client() as store:
        leader = wait_for_leader(store, beats)
        wait_for_slots(observer, "every1", 6, timeout=30)  # the first leader fires
        leader.kill()
        killed = time.monotonic()
        killed_ms = int(time.time() * 1000)
        follower = wait_for_leader(store, beats, not_pid=leader.pid)
        failover = time.monotonic() - killed
        # The follower fires (the slots it took over and new ones), up to the count below.
        wait_for_slots(observer, "every1", 14, timeout=60)
        wait_for_slots(observer, "every1", 3, after_ms=killed_ms, timeout=30)
        follower.stop()
        drain(observer, settle=2)
        print(f"{prod_store.kind}: beat failover after SIGKILL {failover:.2f} s")
        assert_each_slot_once(observer, "every1", 1000, at_least=14)
        assert_outbox_holds_only_unsent_tail(observer, store)
    assert failover < 12, failover
