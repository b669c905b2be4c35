"""The gate script against a real server: all conditions or none, in one call."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis

from celery_baton.core.conditions import (
    ClaimUnique,
    FreeUnique,
    KeepUnique,
    NotDone,
    Override,
    Rate,
    TakeLease,
    attempt_stamp,
)
from celery_baton.core.gate import Gate, HeldLease, Release, owner_task_id
from celery_baton.core.keys import KeyNames
from celery_baton.core.leases import new_owner
from celery_baton.store.connection import connect

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


def owner_fields(r: redis.Redis, key: str) -> list[str]:
    return [f for f in r.hkeys(key) if f.startswith("o:")]


def test_grant_takes_every_condition(gate: Gate, r: redis.Redis) -> None:
    owner = new_owner("task-1", "w@h")
    decision = gate.decide([TakeLease(EX, fence=True), Rate(RATE, 1_000_000)], owner=owner, ttl=5)
    assert decision.granted and decision.fence > 0
    assert owner_fields(r, EX) == [f"o:{owner}"]
    assert r.exists(RATE)
    assert 0 < r.pttl(EX) <= 5000


def test_a_denied_rate_writes_no_lease(gate: Gate, r: redis.Redis) -> None:
    """Lease free, rate spent: denied by the rate, and the free lease is NOT taken."""
    first = gate.decide([Rate(RATE, 10_000_000)], owner=new_owner("a", "w"))
    assert first.granted and first.fence == 0
    tat_before = r.get(RATE)

    owner = new_owner("b", "w")
    decision = gate.decide([TakeLease(EX, fence=True), Rate(RATE, 10_000_000)], owner=owner)
    assert not decision.granted
    assert decision.denied_by == Rate(RATE, 10_000_000)
    assert 0 < decision.retry_after <= 10
    assert not r.exists(EX)  # nothing written: no lease, no fence counter
    assert r.get(RATE) == tat_before


def test_a_denied_lease_spends_no_rate_and_takes_no_other_lease(gate: Gate, r: redis.Redis) -> None:
    holder = new_owner("a", "w")
    assert gate.decide([TakeLease(EX2)], owner=holder, ttl=10).granted

    decision = gate.decide(
        [TakeLease(EX, fence=True), Rate(RATE, 1_000_000), TakeLease(EX2)],
        owner=new_owner("b", "w"),
        ttl=10,
    )
    assert not decision.granted
    assert decision.denied_by == TakeLease(EX2)
    assert decision.holder == holder and decision.holder_task_id == "a"
    assert 0 < decision.retry_after <= 10
    assert not r.exists(EX) and not r.exists(RATE)
    assert owner_fields(r, EX2) == [f"o:{holder}"]


def test_expired_owners_are_swept_when_the_key_is_taken(gate: Gate, r: redis.Redis) -> None:
    dead = new_owner("dead", "w")
    assert gate.decide([TakeLease(EX)], owner=dead, ttl=0.05).granted
    r.hset(EX, "o:ghost|w|1", "1 0")  # an owner whose deadline passed long ago
    live = new_owner("live", "w")
    time.sleep(0.1)
    assert gate.decide([TakeLease(EX)], owner=live, ttl=5).granted
    assert owner_fields(r, EX) == [f"o:{live}"]


def _not_done(gate: Gate, stamp: str, attempt: int = 0) -> bool:
    """Whether a delivery of task-1 published as ``stamp`` (its ``attempt``: Celery's
    retries) passes the done marker."""
    condition = NotDone(DONE, stamp, "task-1", attempt)
    decision = gate.decide([condition, TakeLease(EX)], owner=new_owner("task-1", "w"))
    if decision.granted:
        r = gate.store.client
        r.delete(EX)
        return True
    assert decision.retry_after == -1 and decision.holder == "task-1"
    return False


def test_done_marker_refuses_a_copy_of_a_publish_that_ran_not_a_new_publish(
    gate: Gate, r: redis.Redis
) -> None:
    """The marker records the publishes of the id that finished: a copy of one (same
    stamp) is refused for good, another publish of the same id runs; a message without a
    stamp (sent without celery-baton) is refused once any run of its id finished."""
    assert _not_done(gate, "") and _not_done(gate, "a")  # nothing finished yet
    gate.release([], owner="task-1|w|1", done_key=DONE, done_ttl=60, done_stamp="a")
    assert not _not_done(gate, "a")  # a copy of the publish that ran
    assert _not_done(gate, "b")  # a new publish of task-1
    assert not _not_done(gate, "")  # unstamped: judged by the id
    assert not r.exists(EX)
    gate.release([], owner="task-1|w|2", done_key=DONE, done_ttl=60, done_stamp="b")
    assert not _not_done(gate, "a") and not _not_done(gate, "b")  # both remembered


def test_an_attempt_that_retried_refuses_its_copies_not_its_retry(
    gate: Gate, r: redis.Redis
) -> None:
    """A retry keeps its publish's stamp, one attempt later: the attempt that retried is
    recorded as ``<stamp>@<retries>``, so a copy of its message is refused and the retry
    runs; once a run of the publish finished, every attempt of it is refused."""
    retried = attempt_stamp("a", 0)
    gate.release([], owner="task-1|w|1", done_key=DONE, done_ttl=60, done_stamp=retried)
    assert not _not_done(gate, "a", 0)  # a copy of the attempt that retried
    assert _not_done(gate, "a", 1) and _not_done(gate, "b", 0)  # its retry; a new publish
    gate.release([], owner="task-1|w|2", done_key=DONE, done_ttl=60, done_stamp="a")
    assert not _not_done(gate, "a", 1) and not _not_done(gate, "a", 2)


def test_a_kept_claim_is_taken_again_only_while_the_key_is_free(gate: Gate, r: redis.Redis) -> None:
    """A run whose ack failed keeps its claim for the copy; the run's end may have freed
    it already (before its result was stored): taken again, unless a publish took it."""
    kept = Release((), "task-1|w|1", unique_key=UQ, unique_owner="task-1", unique_keep=30)
    gate.release_many([kept])
    assert r.get(UQ) == "task-1" and 29_000 < r.pttl(UQ) <= 30_000
    r.set(UQ, "task-2")
    gate.release_many([kept])
    assert r.get(UQ) == "task-2" and r.pttl(UQ) == -1


def test_an_unstamped_run_refuses_unstamped_copies_only(gate: Gate, r: redis.Redis) -> None:
    gate.release([], owner="task-1|w|1", done_key=DONE, done_ttl=60)
    assert not _not_done(gate, "")
    assert _not_done(gate, "a")  # a stamped message is another publish than that run


def test_an_older_versions_done_marker_refuses_every_delivery(gate: Gate, r: redis.Redis) -> None:
    """A marker written before publishes were stamped (a string: the task id) refuses any
    delivery of the id, as it did; a release over it records the stamp instead."""
    r.set(DONE, "task-1", px=60_000)
    assert not _not_done(gate, "") and not _not_done(gate, "a")
    gate.release([], owner="task-1|w|1", done_key=DONE, done_ttl=60, done_stamp="a")
    assert r.type(DONE) == "zset" and r.zrange(DONE, 0, -1) == ["a"]
    assert not _not_done(gate, "a") and _not_done(gate, "b")


def test_done_marker_forgets_each_stamp_after_its_retention(gate: Gate, r: redis.Redis) -> None:
    """Each stamp is forgotten after its own retention; the key lives as long as its
    latest stamp, and keeps the latest MAX_STAMPS (a task replacing itself in a loop)."""
    gate.release([], owner="task-1|w|1", done_key=DONE, done_ttl=0.2, done_stamp="a")
    gate.release([], owner="task-1|w|2", done_key=DONE, done_ttl=60, done_stamp="b")
    assert 59_000 < r.pttl(DONE) <= 60_000
    time.sleep(0.3)
    assert _not_done(gate, "a") and not _not_done(gate, "b")
    gate.release([], owner="task-1|w|3", done_key=DONE, done_ttl=1, done_stamp="c")
    assert r.zrange(DONE, 0, -1) == ["c", "b"]  # "a" swept; the ttl not shortened
    assert 58_000 < r.pttl(DONE) <= 60_000
    r.delete(DONE)
    seconds, micros = r.time()
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    r.zadd(DONE, {f"s{n:04d}": now_ms + 30_000 + n for n in range(1005)})
    gate.release([], owner="task-1|w|4", done_key=DONE, done_ttl=60, done_stamp="d")
    assert r.zcard(DONE) == 1000
    assert _not_done(gate, "s0005")  # the six oldest went
    assert not _not_done(gate, "s0006") and not _not_done(gate, "d")


def test_free_unique_frees_only_its_own_claim(gate: Gate, r: redis.Redis) -> None:
    r.set(UQ, "someone-else")
    assert gate.decide([FreeUnique(UQ, "task-1")], owner=new_owner("task-1", "w"))
    assert r.get(UQ) == "someone-else"
    r.set(UQ, "task-1")
    decision = gate.decide(
        [TakeLease(EX), FreeUnique(UQ, "task-1")], owner=new_owner("task-1", "w")
    )
    assert decision.granted
    assert not r.exists(UQ)


def test_keep_unique_extends_only_its_own_claim_and_only_on_grant(
    gate: Gate, r: redis.Redis
) -> None:
    """A claim whose ttl the publish cut to a message's ``expires`` lives ``unique_ttl``
    from the run's start; another task id's claim, and a claim on a denied start, keep
    their ttl."""
    owner = new_owner("task-1", "w")
    r.set(UQ, "task-1", px=2000)
    assert gate.decide([KeepUnique(UQ, "task-1", 3600)], owner=owner).granted
    assert 3_500_000 < r.pttl(UQ) <= 3_600_000

    r.set(UQ, "task-2", px=2000)  # the claim lapsed and a later publish took it
    assert gate.decide([KeepUnique(UQ, "task-1", 3600)], owner=owner).granted
    assert r.get(UQ) == "task-2" and r.pttl(UQ) <= 2000

    assert gate.decide([TakeLease(EX)], owner=new_owner("other", "w")).granted
    r.set(UQ, "task-1", px=2000)
    decision = gate.decide([TakeLease(EX), KeepUnique(UQ, "task-1", 3600)], owner=owner)
    assert not decision.granted
    assert r.pttl(UQ) <= 2000


def test_claim_unique_takes_a_free_key_or_its_own_and_names_another_holder(
    gate: Gate, r: redis.Redis
) -> None:
    """A call published where its options were unknown claims its key in its gate call:
    granted when the key is free or already its own (a redelivered copy), denied naming
    the holder otherwise (waiting cannot help: retry_after < 0); nothing written on a
    denial by another condition."""
    owner = new_owner("task-1", "w")
    assert gate.decide([ClaimUnique(UQ, "task-1", 60)], owner=owner).granted
    assert r.get(UQ) == "task-1" and 59_000 < r.pttl(UQ) <= 60_000
    assert gate.decide([ClaimUnique(UQ, "task-1", 60)], owner=new_owner("task-1", "w2"))

    decision = gate.decide([ClaimUnique(UQ, "task-2", 60)], owner=new_owner("task-2", "w"))
    assert not decision.granted
    assert decision.holder == "task-1" and decision.retry_after < 0
    assert isinstance(decision.denied_by, ClaimUnique)

    r.delete(UQ)
    assert gate.decide([TakeLease(EX)], owner=new_owner("other", "w")).granted
    decision = gate.decide([TakeLease(EX), ClaimUnique(UQ, "task-2", 60)], owner=owner)
    assert not decision.granted
    assert not r.exists(UQ)


def test_a_denied_start_keeps_the_unique_claim(gate: Gate, r: redis.Redis) -> None:
    assert gate.decide([TakeLease(EX)], owner=new_owner("other", "w")).granted
    r.set(UQ, "task-1")
    decision = gate.decide(
        [TakeLease(EX), FreeUnique(UQ, "task-1")], owner=new_owner("task-1", "w")
    )
    assert not decision.granted
    assert r.get(UQ) == "task-1"


def test_release_marks_done_and_frees_only_its_unique_key(gate: Gate, r: redis.Redis) -> None:
    owner = new_owner("task-1", "w")
    assert gate.decide([TakeLease(EX)], owner=owner).granted
    r.set(UQ, "task-2")  # another publish holds the unique key now
    freed = gate.release(
        [EX], owner=owner, done_key=DONE, done_ttl=60, unique_key=UQ, unique_owner="task-1"
    )
    assert freed == 1
    assert r.zrange(DONE, 0, -1) == [""] and 0 < r.pttl(DONE) <= 60_000
    assert r.get(UQ) == "task-2"
    r.set(UQ, "task-1")
    assert gate.release([EX], owner=owner, unique_key=UQ, unique_owner="task-1") == 0
    assert not r.exists(UQ)


def test_owner_task_id() -> None:
    assert owner_task_id("abc-123|w@h|0f0f") == "abc-123"
    assert owner_task_id("") == ""


def test_a_busy_key_always_outlives_its_leases_and_a_used_once_key_vanishes(
    gate: Gate, r: redis.Redis
) -> None:
    """A key shared by many runs is not extended on every acquisition (it is extended
    with room to spare), yet it never expires before a live lease in it."""
    import random

    rng = random.Random(7)
    key = "baton:{t}:cc:busy"
    held: dict[str, int] = {}  # owner -> ttl ms

    def check(step: int) -> None:
        seconds, micros = r.time()
        now_ms = seconds * 1000 + micros // 1000
        pttl = r.pttl(key)
        for field, value in r.hgetall(key).items():
            if field.startswith("o:") and int(value.split()[0]) > now_ms:
                assert pttl >= int(value.split()[0]) - now_ms - 5, (step, field, pttl)

    # Short leases first (the key gets a short expiry), then a longer one that needs more.
    for step, ttl in enumerate([1_000, 1_000, 5_000, 1_000, 20_000]):
        owner = f"first{step}|w|1"
        assert gate.decide([TakeLease(key, limit=9)], owner=owner, ttl=ttl / 1000).granted
        check(step)
    for step in range(5):
        assert gate.release([key], owner=f"first{step}|w|1") == 1
    for step in range(300):
        op = rng.random()
        if held and op < 0.35:
            owner = rng.choice(list(held))
            assert gate.release([key], owner=owner) == 1
            del held[owner]
        elif held and op < 0.5:
            owner = rng.choice(list(held))
            lease = HeldLease(key, owner, 3, held[owner] / 1000)
            assert [x.status for x in gate.renew([lease])] == [1]
        else:
            owner, ttl = f"t{step}|w|1", rng.choice([1_000, 5_000, 20_000])
            if gate.decide([TakeLease(key, limit=3)], owner=owner, ttl=ttl / 1000).granted:
                held[owner] = ttl
        check(step)
    # A key used once and released is gone at once (the redelivery guard's per-id keys).
    once = "baton:{t}:run:task-9"
    assert gate.decide([TakeLease(once)], owner="task-9|w|1", ttl=5).granted
    assert gate.release([once], owner="task-9|w|1") == 1
    assert not r.exists(once)


def test_a_rate_key_outlives_its_schedule_and_then_goes(gate: Gate, r: redis.Redis) -> None:
    """A busy rate key moves its expiry about once a second, not on every decision; it
    must still never expire while its schedule (TAT) is in the future, always carry a
    TTL, and be gone within a second after the schedule ran out."""
    key = "baton:{t}:rate:grain"
    interval = 40_000  # 25/s, burst 3: the TAT runs ahead of the clock and crosses seconds
    granted = 0
    deadline = time.monotonic() + 2.5
    while time.monotonic() < deadline:
        decision = gate.decide([Rate(key, interval, 3)], owner="-", reserve=0.2)
        if decision.granted:
            granted += 1
        # One MULTI: the three read at the same instant of the store's clock (read one
        # by one, the PTTL came a loaded machine's round trips after the TIME).
        (seconds, micros), tat, pttl = (
            r.pipeline(transaction=True).time().get(key).pttl(key).execute()
        )
        now_us = seconds * 1_000_000 + micros
        tat_us = int(tat or 0)
        assert pttl > 0, "a rate key without a TTL"
        # The key outlives its TAT (so no decision forgets the schedule) by at most 1 s.
        assert (tat_us - now_us) / 1000 - 1 <= pttl <= (tat_us - now_us) / 1000 + 1_001
    assert granted > 40


def test_a_runtime_override_replaces_the_next_conditions_limit(gate: Gate, r: redis.Redis) -> None:
    """An "O" condition reads the hash `celery baton limits set` writes; a value that
    does not parse is ignored (the declared limit holds), never an error for the run."""
    limits = "baton:{t}:limits"
    conditions = [Override(limits, "rate"), Rate(RATE, 1_000, 1)]
    assert gate.decide(conditions, owner="-").granted
    assert gate.decide(conditions, owner="-").retry_after < 0.01  # 1 ms interval declared
    r.hset(limits, "rate", "10000000 1")  # one per 10 s
    r.delete(RATE)
    assert gate.decide(conditions, owner="-").granted
    denied = gate.decide(conditions, owner="-")
    assert not denied.granted and denied.retry_after > 9
    r.hset(limits, "rate", "1 2 3")  # not "<interval> [<burst>]"
    r.delete(RATE)
    assert gate.decide(conditions, owner="-").granted
    assert gate.decide(conditions, owner="-").retry_after < 0.01


def test_a_grant_with_a_lease_returns_the_store_epoch_of_its_family(
    gate: Gate, r: redis.Redis
) -> None:
    """The epoch is created by the family's first grant, then only read; a denied call
    writes none, and a call without a lease does not read it."""
    epoch_key = KeyNames().epoch("t")
    assert gate.decide([Rate(RATE, 1_000_000)], owner="a|w|1").epoch == ""
    assert not r.exists(epoch_key)
    first = gate.decide([TakeLease(EX)], owner="b|w|1")
    assert first.granted and first.epoch == r.get(epoch_key)
    assert first.epoch.split()[0].isdigit()  # "<id> <replication id>"
    denied = gate.decide([TakeLease(EX)], owner="c|w|1")
    assert not denied.granted and denied.epoch == ""
    again = gate.decide([Rate(RATE + "2", 1), TakeLease(EX2)], owner="d|w|1")
    assert again.granted and again.epoch == first.epoch
    assert r.get(epoch_key) == first.epoch
