"""The gate script against a real server: all conditions or none, in one call."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis

from celery_baton.gate import Condition, Gate, owner_task_id
from celery_baton.leases import new_owner
from celery_baton.store.connection import connect
from tests.support.servers import StoreServer

EX = "baton:{t}:ex:k"
EX2 = "baton:{t}:ex:k2"
RATE = "baton:{t}:rate:r"
DONE = "baton:{t}:done:task-1"
UQ = "baton:{t}:uq:u"


@pytest.fixture
def gate(store_url: str) -> Iterator[Gate]:
    store = connect(store_url, socket_timeout=2)
    yield Gate(store)
    store.client.close()


@pytest.fixture
def r(store_server: StoreServer, store_url: str) -> Iterator[redis.Redis]:
    with store_server.client() as client:
        yield client


def owner_fields(r: redis.Redis, key: str) -> list[str]:
    return [f for f in r.hkeys(key) if f.startswith("o:")]


def test_grant_takes_every_condition(gate: Gate, r: redis.Redis) -> None:
    owner = new_owner("task-1", "w@h")
    decision = gate.decide(
        [Condition.lease(EX, fence=True), Condition.rate(RATE, 1_000_000)], owner=owner, ttl=5
    )
    assert decision.granted and decision.fence > 0
    assert owner_fields(r, EX) == [f"o:{owner}"]
    assert r.exists(RATE)
    assert 0 < r.pttl(EX) <= 5000


def test_a_denied_rate_writes_no_lease(gate: Gate, r: redis.Redis) -> None:
    """Lease free, rate spent: denied by the rate, and the free lease is NOT taken."""
    first = gate.decide([Condition.rate(RATE, 10_000_000)], owner=new_owner("a", "w"))
    assert first.granted and first.fence == 0
    tat_before = r.get(RATE)

    owner = new_owner("b", "w")
    decision = gate.decide(
        [Condition.lease(EX, fence=True), Condition.rate(RATE, 10_000_000)], owner=owner
    )
    assert not decision.granted
    assert decision.denied_by == Condition.rate(RATE, 10_000_000)
    assert 0 < decision.retry_after <= 10
    assert not r.exists(EX)  # nothing written: no lease, no fence counter
    assert r.get(RATE) == tat_before


def test_a_denied_lease_spends_no_rate_and_takes_no_other_lease(gate: Gate, r: redis.Redis) -> None:
    holder = new_owner("a", "w")
    assert gate.decide([Condition.lease(EX2)], owner=holder, ttl=10).granted

    decision = gate.decide(
        [Condition.lease(EX, fence=True), Condition.rate(RATE, 1_000_000), Condition.lease(EX2)],
        owner=new_owner("b", "w"),
        ttl=10,
    )
    assert not decision.granted
    assert decision.denied_by == Condition.lease(EX2)
    assert decision.holder == holder and decision.holder_task_id == "a"
    assert 0 < decision.retry_after <= 10
    assert not r.exists(EX) and not r.exists(RATE)
    assert owner_fields(r, EX2) == [f"o:{holder}"]


def test_expired_owners_are_swept_when_the_key_is_taken(gate: Gate, r: redis.Redis) -> None:
    dead = new_owner("dead", "w")
    assert gate.decide([Condition.lease(EX)], owner=dead, ttl=0.05).granted
    r.hset(EX, "o:ghost|w|1", "1 0")  # an owner whose deadline passed long ago
    live = new_owner("live", "w")
    time.sleep(0.1)
    assert gate.decide([Condition.lease(EX)], owner=live, ttl=5).granted
    assert owner_fields(r, EX) == [f"o:{live}"]


def test_done_marker_denies_for_good(gate: Gate, r: redis.Redis) -> None:
    r.set(DONE, "task-1")
    decision = gate.decide(
        [Condition.not_done(DONE), Condition.lease(EX)], owner=new_owner("task-1", "w")
    )
    assert not decision.granted
    assert decision.retry_after == -1 and decision.holder == "task-1"
    assert not r.exists(EX)


def test_free_unique_frees_only_its_own_claim(gate: Gate, r: redis.Redis) -> None:
    r.set(UQ, "someone-else")
    assert gate.decide([Condition.free_unique(UQ, "task-1")], owner=new_owner("task-1", "w"))
    assert r.get(UQ) == "someone-else"
    r.set(UQ, "task-1")
    decision = gate.decide(
        [Condition.lease(EX), Condition.free_unique(UQ, "task-1")], owner=new_owner("task-1", "w")
    )
    assert decision.granted
    assert not r.exists(UQ)


def test_a_denied_start_keeps_the_unique_claim(gate: Gate, r: redis.Redis) -> None:
    assert gate.decide([Condition.lease(EX)], owner=new_owner("other", "w")).granted
    r.set(UQ, "task-1")
    decision = gate.decide(
        [Condition.lease(EX), Condition.free_unique(UQ, "task-1")], owner=new_owner("task-1", "w")
    )
    assert not decision.granted
    assert r.get(UQ) == "task-1"


def test_release_marks_done_and_frees_only_its_unique_key(gate: Gate, r: redis.Redis) -> None:
    owner = new_owner("task-1", "w")
    assert gate.decide([Condition.lease(EX)], owner=owner).granted
    r.set(UQ, "task-2")  # another publish holds the unique key now
    freed = gate.release(
        [EX], owner=owner, done_key=DONE, done_ttl=60, unique_key=UQ, unique_owner="task-1"
    )
    assert freed == 1
    assert r.get(DONE) == "task-1" and 0 < r.pttl(DONE) <= 60_000
    assert r.get(UQ) == "task-2"
    r.set(UQ, "task-1")
    assert gate.release([EX], owner=owner, unique_key=UQ, unique_owner="task-1") == 0
    assert not r.exists(UQ)


def test_owner_task_id() -> None:
    assert owner_task_id("abc-123|w@h|0f0f") == "abc-123"
    assert owner_task_id("") == ""
