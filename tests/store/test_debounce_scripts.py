"""The debounce and throttle scripts against a real server, step by step: what each
delivery is told, and what the store remembers (read back directly)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis

from celery_baton.debounce import (
    Debounces,
    FlowDecision,
    FlowKind,
    FlowPolicy,
    Outcome,
    parse_decision,
)
from celery_baton.keys import KeyNames
from celery_baton.store.connection import Store, connect

KEY = "baton:{t}:db:k"
TH = "baton:{t}:th:k"
DEBOUNCE = FlowPolicy(FlowKind.DEBOUNCE, 0.3, None)
CAPPED = FlowPolicy(FlowKind.DEBOUNCE, 0.3, None, max_wait=0.5)


@pytest.fixture
def store(store_url: str) -> Iterator[Store]:
    store = connect(store_url, socket_timeout=2)
    yield store
    store.client.close()


def decide(store: Store, policy: FlowPolicy, task_id: str, key: str = KEY) -> FlowDecision:
    script, keys, args = policy.decide_call(key, task_id, "")
    return parse_decision(store.scripts.call(script, keys, args))


def test_a_burst_runs_its_latest_once_quiet_for_everyone(store: Store, r: redis.Redis) -> None:
    debounces = Debounces(store, KeyNames())
    for task_id in ("a", "b", "c"):
        assert debounces.record(DEBOUNCE, KEY, task_id)
    assert decide(store, DEBOUNCE, "a") == FlowDecision(Outcome.SKIP, holder="c")
    wait = decide(store, DEBOUNCE, "c")
    assert wait.outcome is Outcome.WAIT and 0.2 < wait.delay <= 0.3
    time.sleep(wait.delay)
    run = decide(store, DEBOUNCE, "c")
    assert run.outcome is Outcome.RUN and sorted(run.stands_for) == ["a", "b"]
    # Closed: late copies are skipped in favour of the run; the run's own copy (its
    # worker died) runs again for the same ids; a new publish starts a new burst.
    assert decide(store, DEBOUNCE, "b") == FlowDecision(Outcome.SKIP, holder="c")
    again = decide(store, DEBOUNCE, "c")
    assert again.outcome is Outcome.RUN and sorted(again.stands_for) == ["a", "b"]
    assert not debounces.record(DEBOUNCE, KEY, "b")  # known: nothing written
    assert debounces.record(DEBOUNCE, KEY, "d")
    assert r.hget(KEY, "latest") == "d"
    assert r.pttl(KEY) > 0 and r.pttl(f"{KEY}:ran") > 0


def test_an_unrecorded_delivery_is_adopted_as_the_latest(store: Store, r: redis.Redis) -> None:
    debounces = Debounces(store, KeyNames())
    debounces.record(DEBOUNCE, KEY, "a")
    assert decide(store, DEBOUNCE, "lost-record").outcome is Outcome.WAIT
    assert r.hget(KEY, "latest") == "lost-record"
    assert not debounces.record(DEBOUNCE, KEY, "lost-record")  # its record came late
    assert r.hget(KEY, "latest") == "lost-record"
    assert decide(store, DEBOUNCE, "a").outcome is Outcome.SKIP


def test_max_wait_cuts_a_stream(store: Store) -> None:
    debounces = Debounces(store, KeyNames())
    start = time.monotonic()
    n = 0
    while True:
        n += 1
        debounces.record(CAPPED, KEY, f"p{n}")
        decision = decide(store, CAPPED, f"p{n}")
        if decision.outcome is Outcome.RUN:
            break
        assert time.monotonic() - start < 5, "never cut"
        time.sleep(0.05)
    # Never quiet for 0.3 s, yet it ran: cut at max_wait (0.5 s), for every publish.
    assert 0.4 < time.monotonic() - start < 3
    assert len(decision.stands_for) == n - 1


def test_throttle_drop_and_trailing(store: Store) -> None:
    drop = FlowPolicy(FlowKind.THROTTLE, 0.3, None)
    assert decide(store, drop, "a", TH).outcome is Outcome.RUN
    assert decide(store, drop, "b", TH) == FlowDecision(Outcome.SKIP, holder="a")
    assert decide(store, drop, "a", TH).outcome is Outcome.RUN  # its own copy again
    time.sleep(0.31)
    assert decide(store, drop, "c", TH).outcome is Outcome.RUN

    trailing = FlowPolicy(FlowKind.THROTTLE, 0.3, None, mode="trailing")
    key = TH + "2"
    assert decide(store, trailing, "a", key).outcome is Outcome.RUN
    assert decide(store, trailing, "b", key).outcome is Outcome.WAIT
    wait = decide(store, trailing, "c", key)
    assert wait.outcome is Outcome.WAIT
    assert decide(store, trailing, "b", key) == FlowDecision(Outcome.SKIP, holder="c")
    time.sleep(wait.delay)
    run = decide(store, trailing, "c", key)
    assert run.outcome is Outcome.RUN and run.stands_for == ("b",)
    assert decide(store, trailing, "d", key).outcome is Outcome.WAIT  # a new window
