"""beat_missed.lua: a worker counts a held beat slot it did not run in its entry."""

from __future__ import annotations

import json

import redis

from celery_baton.beat.state import BeatKeys
from celery_baton.store.connection import connect

KEYS = BeatKeys(app="proj")


def _call(store_url: str, line: dict[str, object], history: int = 3) -> int:
    store = connect(store_url, socket_timeout=5)
    try:
        keys = [KEYS.entry("tick"), KEYS.history("tick")]
        return int(store.scripts.run("beat_missed", keys, [json.dumps(line), history]))
    finally:
        store.client.close()


def test_counted_with_a_bounded_history(store_url: str, r: redis.Redis) -> None:
    r.hset(KEYS.entry("tick"), mapping={"next": "1", "missed": "2"})
    for slot in range(5):
        assert _call(store_url, {"kind": "missed", "count": 1, "first": slot}) == 1
    assert r.hget(KEYS.entry("tick"), "missed") == "7"
    lines = [json.loads(x) for x in r.lrange(KEYS.history("tick"), 0, -1)]
    assert [x["first"] for x in lines] == [4, 3, 2]  # newest first, 3 kept


def test_an_entry_removed_meanwhile_is_not_made_again(store_url: str, r: redis.Redis) -> None:
    assert _call(store_url, {"kind": "missed", "count": 1}) == 0
    assert not r.exists(KEYS.entry("tick"), KEYS.history("tick"))
