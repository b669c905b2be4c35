"""Real ``celery beat`` processes (celery_baton.beat:Scheduler) and a real worker.

Every run is counted from the worker side: the task records ``<entry>|<slot>`` with the
observer (the slot comes from the message's header), so a duplicate message or a
missing slot shows up no matter which beat sent it.
"""

from __future__ import annotations

import os
import time

import pytest
import redis

from celery_baton.beat import slot_task_id
from tests.beat.helpers import (
    BEAT_KEYS,
    assert_outbox_holds_only_unsent_tail,
    beat_env,
    leader_pid,
    runs_per_slot,
    wait_for_leader,
)
from tests.support.celery_processes import BeatProcess
from tests.support.observer import Observer
from tests.support.servers import StoreServer
from tests.support.workers import Workers

APP = "tests.apps.beat_app"


def assert_each_slot_once(observer: Observer, entry: str, step_ms: int, at_least: int) -> None:
    counts = runs_per_slot(observer, entry)
    duplicated = {slot: n for slot, n in counts.items() if n != 1}
    assert not duplicated, f"{entry}: slots run more than once: {duplicated}"
    slots = sorted(counts)
    assert len(slots) >= at_least, f"{entry}: only {len(slots)} slots ran"
    missing = sorted(set(range(slots[0], slots[-1] + 1, step_ms)) - set(slots))
    assert not missing, f"{entry}: slots never ran: {missing}"


def assert_ids_derived_from_slots(observer: Observer) -> None:
    for start in observer.started():
        entry, _, slot = start["key"].partition("|")
        assert start["task_id"] == slot_task_id("baton", entry, int(slot), app="beat_app")


def drain(observer: Observer, settle: float = 3.0) -> None:
    """Wait until no new run started for ``settle`` seconds."""
    seen = -1
    while True:
        now = len(observer.started())
        if now == seen:
            return
        seen = now
        time.sleep(settle)


#: How long the three beats run (s). The suite's form: two SIGKILLs and a SIGTERM in
#: 45 s. ``BATON_TEST_BEAT_SECONDS=145`` is the long form, long enough for a minutely
#: cron entry to fire across the failovers too.
BEAT_SECONDS = float(os.environ.get("BATON_TEST_BEAT_SECONDS", "45"))


@pytest.mark.slow
@pytest.mark.timeout(BEAT_SECONDS + 120)
def test_three_beats_leader_killed_twice_each_slot_once(
    workers: Workers, observer: Observer, store_server: StoreServer, store: redis.Redis
) -> None:
    # every1 catches up (baton_misfire="all"): each slot runs, once, across the failovers;
    # the default (late slots coalesced) is tests/beat/test_late_slots.py.
    env = beat_env(
        {
            "every1": {"every": 1, "options": {"baton_misfire": "all"}},
            "minutely": {"cron": "* * * * *"},
        }
    )
    workers.start(APP, env=env, concurrency=4)
    beats: list[BeatProcess] = [workers.start_beat(APP, env=env, wait=False) for _ in range(3)]
    for beat in beats:
        beat.wait_started()
    began = time.monotonic()
    leader = wait_for_leader(store, beats)
    failovers: list[float] = []
    for at in (BEAT_SECONDS * 0.2, BEAT_SECONDS * 0.5):
        time.sleep(max(0.0, began + at - time.monotonic()))
        leader.kill()
        killed = time.monotonic()
        leader = wait_for_leader(store, beats, not_pid=leader.pid)
        failovers.append(time.monotonic() - killed)
        beats.append(workers.start_beat(APP, env=env))  # the killed one "restarted"
    time.sleep(max(0.0, began + BEAT_SECONDS - time.monotonic()))
    # SIGTERM: the leader resigns in close(), a follower takes over on its next poll.
    leader.stop()
    stopped = time.monotonic()
    leader = wait_for_leader(store, beats, not_pid=leader.pid)
    handover = time.monotonic() - stopped
    time.sleep(3)
    for beat in beats:
        beat.stop()
    drain(observer)
    print(f"failover after SIGKILL: {failovers}; handover after SIGTERM: {handover:.2f} s")

    assert_each_slot_once(observer, "every1", 1000, at_least=int(BEAT_SECONDS) - 5)
    minutes = int(BEAT_SECONDS // 60)
    if minutes:
        assert_each_slot_once(observer, "minutely", 60_000, at_least=minutes)
    else:  # a minute boundary may or may not have passed: never twice
        assert all(n == 1 for n in runs_per_slot(observer, "minutely").values())
    assert_ids_derived_from_slots(observer)
    for name in ("every1", "minutely"):
        assert store.hget(BEAT_KEYS.entry(name), "missed") is None
    assert_outbox_holds_only_unsent_tail(observer, store)
    # Default lease ttl is 6 s; the bound is loose for a loaded 2-core machine.
    assert max(failovers) < 12, failovers
    assert handover < 5, handover


@pytest.mark.timeout(120)  # ~15-30 s here; 60 s is the default
def test_store_restart_beat_goes_on_and_bad_entries_are_refused(
    workers: Workers, observer: Observer, store_server: StoreServer, store: redis.Redis
) -> None:
    env = beat_env(
        {
            "every1": {
                "every": 1,
                "options": {"baton_misfire": "all"},
            },  # each slot, across the restart
            "zero": {"every": 0},
            "ghost": {"every": 5, "task": "no.such.task"},
        }
    )
    workers.start(APP, env=env, concurrency=2)
    beats = [workers.start_beat(APP, env=env, wait=False) for _ in range(2)]
    wait_for_leader(store, beats)
    time.sleep(8)
    before = len(runs_per_slot(observer, "every1"))
    store_server.restart(down_for=3)
    time.sleep(12)
    for beat in beats:
        beat.stop()
    drain(observer)

    counts = runs_per_slot(observer, "every1")
    assert len(counts) > before + 8, "beat did not go on after the store restart"
    assert_each_slot_once(observer, "every1", 1000, at_least=18)
    assert set(runs_per_slot(observer, "zero")) == set()
    for beat in beats:
        log = beat.log_text()
        assert "refusing beat entry 'zero': interval must be > 0 s" in log
        assert "refusing beat entry 'ghost': unknown task 'no.such.task'" in log
    refused = store.hgetall(BEAT_KEYS.refused)
    assert set(refused) == {"zero", "ghost"}


@pytest.mark.timeout(120)  # ~15-30 s here; 60 s is the default
def test_single_beat_restarted_no_extra_runs(
    workers: Workers, observer: Observer, store_server: StoreServer, store: redis.Redis
) -> None:
    env = beat_env({"every2": {"every": 2, "options": {"baton_misfire": "all"}}})
    workers.start(APP, env=env, concurrency=2)
    for _ in range(5):
        beat = workers.start_beat(APP, env=env)
        wait_for_leader(store, [beat])
        time.sleep(2.5)
        beat.stop()
        assert leader_pid(store) is None  # resigned on SIGTERM
    drain(observer)
    assert_each_slot_once(observer, "every2", 2000, at_least=5)
