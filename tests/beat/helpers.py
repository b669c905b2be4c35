"""Shared helpers of the beat tests: which beat leads, what ran per slot."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import redis

from celery_baton.beat.state import BeatKeys
from tests.support.celery_processes import BeatProcess
from tests.support.observer import Observer
from tests.support.workers import Workers

#: The keys of tests.apps.beat_app's beat. Built by the library, not spelled here: each
#: app's beat keys carry its name in their hash tag (a Cluster test that kills "the beat
#: keys' master" must kill that slot's master, not the master of a look-alike key).
BEAT_KEYS = BeatKeys(app="beat_app")
LEADER_KEY = BEAT_KEYS.leader


def beat_env(entries: dict[str, Any], **settings: Any) -> dict[str, str]:
    """Env for ``tests.apps.beat_app``: its entries and ``baton_beat_*`` settings."""
    env = {"BEAT_ENTRIES": json.dumps(entries)}
    for name, value in settings.items():
        env[f"BATON_BEAT_{name.upper()}"] = json.dumps(value)
    return env


def start_two_beats(workers: Workers, env: dict[str, str]) -> list[BeatProcess]:
    """Two beats of ``tests.apps.beat_app``, started together (they race for the lease),
    once both are up."""
    beats = [workers.start_beat("tests.apps.beat_app", env=env, wait=False) for _ in "ab"]
    for beat in beats:
        beat.wait_started()
    return beats


def leader_pid(store: redis.Redis) -> int | None:
    owner = store.hget(LEADER_KEY, "owner")
    return int(str(owner).split(":")[1]) if owner else None


def wait_for_leader(
    store: redis.Redis, beats: Sequence[BeatProcess], timeout: float = 30, not_pid: int = 0
) -> BeatProcess:
    """The beat process that holds the lease (other than ``not_pid``), once one does."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            pid = leader_pid(store)
        except redis.RedisError:
            pid = None
        for beat in beats:
            if pid and pid == beat.pid and pid != not_pid and beat.is_running:
                return beat
        time.sleep(0.05)
    raise AssertionError(f"no beat leads after {timeout} s (lease: {store.hgetall(LEADER_KEY)})")


def runs_per_slot(observer: Observer, entry: str) -> Counter[int]:
    """How many runs started per slot of ``entry`` (killed runs included)."""
    counts: Counter[int] = Counter()
    for start in observer.started():
        name, _, slot = str(start["key"]).partition("|")
        if name == entry:
            counts[int(slot)] += 1
    return counts


def wait_for_slots(
    observer: Observer, entry: str, n: int, *, after_ms: int = 0, timeout: float = 60
) -> None:
    """Wait until runs of ``n`` distinct slots of ``entry`` later than ``after_ms`` (epoch
    ms) started: a beat seen firing, instead of a fixed time that ends in a count."""
    deadline = time.monotonic() + timeout
    while True:
        fired = sum(1 for slot in runs_per_slot(observer, entry) if slot > after_ms)
        if fired >= n:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{entry}: {fired} slots after {after_ms} ms in {timeout} s")
        time.sleep(0.1)


def wait_for_leading_log(beats: Sequence[BeatProcess], timeout: float = 30) -> BeatProcess:
    """The first beat process whose log says it leads (read from outside the store)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for beat in beats:
            if "beat: leading the schedule" in beat.log_text():
                return beat
        time.sleep(0.1)
    raise AssertionError(f"no beat logged that it leads after {timeout} s")


def assert_outbox_holds_only_unsent_tail(observer: Observer, store: redis.Redis) -> None:
    """What the stopped beats left in the outbox is a slot the next leader sends.

    SIGTERM raises SystemExit wherever the leader's main thread is, possibly between a
    claim and its publish (or between the publish and the outbox clear): the item stays
    for the next leader, by design. It must be a slot later than every slot that ran
    (claimed, not sent) or one that ran (sent, not yet cleared), never a hole.
    (A CI run of an earlier session, on a commit since lost, stopped a leader in that moment.)
    """
    for task_id, raw in store.hgetall(BEAT_KEYS.outbox).items():
        item = json.loads(raw)
        ran = runs_per_slot(observer, item["entry"])
        slot = int(item["slot"])
        assert slot in ran or not ran or slot > max(ran), (task_id, item, sorted(ran)[-3:])
