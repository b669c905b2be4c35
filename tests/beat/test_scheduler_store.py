"""The Scheduler when the store loses data or goes down, and the store's clock as its
"now".

The Scheduler in-process against the real store, with a controlled clock. Publishing is
recorded instead of sent (``RecordingScheduler``); real beat processes and workers are in
test_processes.py.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
from celery import Celery

from tests.beat.conftest import Clock, RecordingScheduler
from tests.beat.scheduler_helpers import Build, entry, tick


def test_store_data_lost_beat_goes_on_without_duplicates(
    make_app: Callable[..., Celery], clock: Clock, schedulers: Build, store_url: str
) -> None:
    """A store restarted empty (no persistence): entries are redefined from now."""
    s = schedulers(make_app({"e": entry(5.0)}), clock)
    tick(s)
    for _ in range(3):
        clock.advance(5)
        tick(s)
    with redis.Redis.from_url(store_url) as r:
        r.flushall()
    for _ in range(4):
        clock.advance(5)
        tick(s)
    slots = [slot for _, slot, _ in s.sent]
    assert len(slots) == len(set(slots)) >= 5
    assert slots == sorted(slots)


def test_a_claim_the_store_lost_is_written_back_not_sent_again(
    make_app: Callable[..., Celery], clock: Clock, schedulers: Build, store_url: str
) -> None:
    """The store loses the leader's last claim but keeps the rest (a master change to a
    replica that was behind; a planned Sentinel failover, the old master writable a
    moment longer): the entry's next slot is one this beat already sent. It writes its
    claim back instead of sending that slot again."""
    s = schedulers(make_app({"e": entry(5.0)}), clock)
    tick(s)
    key = "baton:{beat:beat_inproc}:entry:e"
    with redis.Redis.from_url(store_url, decode_responses=True) as r:
        for _ in range(3):
            before = r.hget(key, "next")
            clock.advance(5)
            tick(s)
        assert r.hget(key, "next") != before
        r.hset(key, "next", before)  # the last claim is gone
        for _ in range(4):
            clock.advance(5)
            tick(s)
        history = [
            json.loads(line) for line in r.lrange("baton:{beat:beat_inproc}:history:e", 0, -1)
        ]
    slots = [slot for _, slot, _ in s.sent]
    assert len(slots) == len(set(slots)) >= 6, slots
    assert slots == sorted(slots)
    restored = [h for h in history if h["kind"] == "restored"]
    assert [(h["from"], h["next"]) for h in restored] == [(int(before), int(before) + 5000)]


def test_store_down_fires_nothing_and_resumes(
    make_app: Callable[..., Celery], clock: Clock, schedulers: Build, store_server: Any
) -> None:
    s = schedulers(make_app({"e": entry(1.0, baton_misfire="all")}), clock)
    tick(s)
    clock.advance(1)
    tick(s)
    store_server.stop()
    try:
        for _ in range(3):
            clock.advance(1)
            assert tick(s) > 0  # logs and retries; no exception escapes
        assert len(s.sent) == 1  # nothing fired unclaimed
    finally:
        store_server.start()
    clock.advance(1)
    tick(s)
    tick(s)
    slots = [slot for _, slot, _ in s.sent]
    assert len(slots) == len(set(slots)) == 5  # the down time's slots caught up (grace)


def test_now_follows_the_store_clock_not_the_host_wall_clock(
    make_app: Callable[..., Celery], store: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A jump of the host's wall clock moves neither "now" nor the slots (no burst)."""
    s = RecordingScheduler(make_app({"e": entry(1.0)}))
    s.sent = []
    try:
        s.tick()
        real_time = time.time
        monkeypatch.setattr(time, "time", lambda: real_time() + 3600)
        seconds, micros = store.time()
        server_ms = int(seconds) * 1000 + int(micros) // 1000
        assert abs(s.now_ms() - server_ms) < 1000
        s.tick()
        assert s.sent == []  # the entry's first slot is 1 s away, not an hour ago
    finally:
        s.close()
