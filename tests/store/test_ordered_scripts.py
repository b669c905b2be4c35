"""The ordered scripts on a real store, step by step: the place a publish takes
(ordered_stamp.lua), the turn (gate/ordered.lua, "Q"), the end that moves the line
(release.lua), the gap bound. The worker-level proof is tests/ordered/test_ordered.py."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis

from celery_baton.core.conditions import InOrder, TakeLease
from celery_baton.core.gate import Decision, Gate, Release
from celery_baton.core.keys import KeyNames
from celery_baton.core.ordered import Note, OrderedStamps, Place, Turn
from celery_baton.store.connection import connect

NAMES = KeyNames("baton")
RECORD = NAMES.ordered("t", "k")
LEASE = NAMES.lease("t", "ex", "k")
LIFE_MS = 60_000


@pytest.fixture
def parts(store_url: str) -> Iterator[tuple[Gate, OrderedStamps]]:
    store = connect(store_url, socket_timeout=2)
    yield Gate(store, notice_channel="baton:released"), OrderedStamps(store, NAMES)
    store.client.close()


def ask(gate: Gate, place: Place | str, owner: str, gap_ms: int = 60_000) -> Decision:
    header = place.header() if isinstance(place, Place) else place
    conditions = [InOrder(RECORD, header, gap_ms, LIFE_MS), TakeLease(LEASE, fence=True)]
    return gate.decide(conditions, owner=f"{owner}|w|1", ttl=5)


def end(gate: Gate, place: Place, owner: str, how: str, hold_ms: int = 0) -> None:
    release = Release(
        (LEASE,),
        f"{owner}|w|1",
        order=f"{place.epoch} {place.position} {how} {hold_ms}",
        order_key=RECORD,
        order_lease=LEASE,
    )
    gate.release_many([release])


def turn(decision: Decision) -> Turn:
    assert not decision.granted and isinstance(decision.denied_by, InOrder), decision
    return Turn.parse(decision.holder)


def test_places_are_consecutive_and_only_the_next_one_runs(
    parts: tuple[Gate, OrderedStamps], r: redis.Redis
) -> None:
    gate, stamps = parts
    first, second, third = (stamps.take("t", "k", '{"k":1}') for _ in range(3))
    assert [first.position, second.position, third.position] == [1, 2, 3]
    assert first.epoch == second.epoch == third.epoch
    assert r.hget(RECORD, "k") == '{"k":1}' and 0 < r.pttl(RECORD) <= 7 * 86400 * 1000

    assert turn(ask(gate, third, "c")) == Turn("wait", 1)
    assert turn(ask(gate, second, "b")) == Turn("wait", 1)
    assert ask(gate, first, "a").granted


def test_a_final_end_moves_the_line_and_announces_it_a_retry_keeps_its_place(
    parts: tuple[Gate, OrderedStamps], r: redis.Redis
) -> None:
    gate, stamps = parts
    first, second = stamps.take("t", "k"), stamps.take("t", "k")
    assert ask(gate, first, "a").granted
    turn(ask(gate, second, "b"))  # waits: the advance is announced
    pubsub = r.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe("baton:released")
    time.sleep(0.05)

    end(gate, first, "a", "0", hold_ms=5_000)  # a retry: keeps its place
    assert turn(ask(gate, second, "b")) == Turn("wait", 1)
    assert ask(gate, first, "a2").granted  # the retry runs

    end(gate, first, "a2", "1")  # final: the line moves, the waiter is told
    message = None
    for _ in range(20):
        message = pubsub.get_message(timeout=0.1)
        if message:
            break
    assert message is not None and message["data"] == LEASE
    assert ask(gate, second, "b").granted
    # A copy of the first call (its ack was lost) is refused as run.
    assert turn(ask(gate, first, "a3")) == Turn("ran", 2)


def test_the_pool_process_moves_the_line_and_the_workers_release_wakes(
    parts: tuple[Gate, OrderedStamps], r: redis.Redis
) -> None:
    gate, stamps = parts
    first, second = stamps.take("t", "k"), stamps.take("t", "k")
    assert ask(gate, first, "a").granted
    turn(ask(gate, second, "b"))
    gate.release_many(
        [Release((), "a|w|1", order=f"{first.epoch} 1 3 0", order_key=RECORD, order_lease=LEASE)]
    )
    assert r.hget(RECORD, "q") == "2" and r.hget(RECORD, "w") == "1"  # nobody woken
    blocked = ask(gate, second, "b")  # its turn, but the lease is still held
    assert not blocked.granted and isinstance(blocked.denied_by, TakeLease)
    end(gate, first, "a", "1")  # the worker frees the lease: waiters are woken
    assert r.hget(RECORD, "w") is None
    assert ask(gate, second, "b").granted


def test_the_gap_bound_skips_a_missing_position_up_to_the_first_that_waits(
    parts: tuple[Gate, OrderedStamps], r: redis.Redis
) -> None:
    gate, stamps = parts
    places = [stamps.take("t", "k") for _ in range(4)]  # 1 and 2 never come
    assert turn(ask(gate, places[2], "c", gap_ms=300)) == Turn("wait", 1)  # 3 is present
    time.sleep(0.4)
    late = ask(gate, places[3], "d", gap_ms=300)  # 4 asks first: 3 waits, so 3 is next
    assert turn(late) == Turn("wait", 3) and Note.parse(late.note).skipped == (1, 2)
    assert r.hget(RECORD, "q") == "3" and r.hget(RECORD, "g") == "2"
    assert ask(gate, places[2], "c", gap_ms=300).granted
    # Position 1 comes after all: refused, its successors ran.
    assert turn(ask(gate, places[0], "a", gap_ms=300)) == Turn("gap", 3)


def test_a_running_call_is_never_skipped_and_its_lapsed_lease_starts_the_gap_clock(
    parts: tuple[Gate, OrderedStamps],
) -> None:
    gate, stamps = parts
    first, second = stamps.take("t", "k"), stamps.take("t", "k")
    assert ask(gate, first, "a", gap_ms=300).granted  # runs (lease ttl 5 s)
    time.sleep(0.4)
    waiting = ask(gate, second, "b", gap_ms=300)
    assert turn(waiting) == Turn("wait", 1) and 4 < waiting.retry_after <= 5


def test_a_call_given_up_before_its_turn_is_passed_over(
    parts: tuple[Gate, OrderedStamps],
) -> None:
    gate, stamps = parts
    first, second, third = (stamps.take("t", "k") for _ in range(3))
    assert ask(gate, first, "a").granted
    end(gate, second, "b", "2")  # cancelled while it waited
    end(gate, first, "a", "1")
    assert ask(gate, third, "c").granted


def test_an_unstamped_call_is_given_the_next_place_and_a_lost_record_runs_in_arrival_order(
    parts: tuple[Gate, OrderedStamps], r: redis.Redis
) -> None:
    gate, _ = parts
    given = ask(gate, "", "x")
    assert given.granted and Note.parse(given.note).assigned == Place(str(r.hget(RECORD, "e")), 1)
    r.delete(RECORD, LEASE)
    lost = ask(gate, Place("17", 5), "y")
    assert lost.granted and Note.parse(lost.note).lost


def test_a_place_given_to_an_idle_key_starts_its_gap_clock_then(
    parts: tuple[Gate, OrderedStamps],
) -> None:
    """The key went idle longer ago than the gap bound: the next place is next from its
    publish, so a later call asking at once waits for it (the nemesis soak, seed 3811,
    saw it skipped at once). Likewise for a place given to an unstamped call."""
    gate, stamps = parts
    first = stamps.take("t", "k")
    assert ask(gate, first, "a", gap_ms=300).granted
    end(gate, first, "a", "1")
    time.sleep(0.4)  # idle past the gap bound
    second, third = stamps.take("t", "k"), stamps.take("t", "k")
    waiting = ask(gate, third, "c", gap_ms=300)
    assert turn(waiting) == Turn("wait", 2) and not Note.parse(waiting.note).skipped
    assert ask(gate, second, "b", gap_ms=300).granted
    end(gate, second, "b", "1")
    assert ask(gate, third, "c", gap_ms=300).granted
    end(gate, third, "c", "1")

    time.sleep(0.4)
    unstamped = ask(gate, "", "x", gap_ms=300)  # given position 4, next at once
    assert unstamped.granted and Note.parse(unstamped.note).assigned is not None
    assert not Note.parse(unstamped.note).skipped
