"""The worker's pipelined store channel, on kombu's real event loop and a real server.

The loop calls the channel back twice per turn: ``_write`` just before it polls
(kombu's ``on_tick``) and ``_on_readable`` when the socket has replies. Some tests
below make those two calls by hand, in the order a loop would, to put the channel in
an exact state (a write in flight) that a running loop passes through too fast to see.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from kombu.asynchronous import Hub

from celery_baton.core.conditions import Condition, TakeLease
from celery_baton.core.gate import Release, gate_call, parse_decision
from celery_baton.store.channel import PipelinedChannel
from celery_baton.store.connection import Store, connect
from tests.support.waiting import wait_until


@pytest.fixture
def store(store_url: str) -> Iterator[Store]:
    store = connect(store_url, socket_timeout=2)
    yield store
    store.client.close()


@pytest.fixture
def hub() -> Iterator[Hub]:
    hub = Hub()
    yield hub
    hub.close()


def key(i: int) -> str:
    return f"baton:{{ch}}:ex:k{i}"


class Calls:
    """Gate calls, one exclusive key each, and the answers they got, in answer order."""

    def __init__(self, channel: PipelinedChannel) -> None:
        self.channel = channel
        self.answers: list[tuple[int, Any]] = []

    def make(self, numbers: range, *, urgent: bool = False) -> None:
        for i in numbers:
            conditions = [TakeLease(key(i))]
            keys, args = gate_call(conditions, f"t{i}|w|1", 5)

            def answer(reply: Any, i: int = i, conditions: list[Condition] = conditions) -> None:
                if isinstance(reply, BaseException):
                    self.answers.append((i, reply))
                else:
                    self.answers.append((i, parse_decision(conditions, reply).granted))

            self.channel.call("gate", keys, args, answer, urgent=urgent)


def test_calls_over_many_loop_turns_are_answered_once_each_in_order(store: Store, hub: Hub) -> None:
    channel = PipelinedChannel(store, hub, hub.timer, timeout=2)
    calls = Calls(channel)
    loop = hub.create_loop()
    made = 0
    deadline = time.monotonic() + 10
    while len(calls.answers) < 200 and time.monotonic() < deadline:
        if made < 200:  # a few new calls every turn, some while others are in flight
            calls.make(range(made, made + 7))
            made += 7
        next(loop)
    channel.close()
    assert calls.answers[:200] == [(i, True) for i in range(200)]


def connected(channel: PipelinedChannel) -> None:
    """What the loop does when the connector thread is done: take its connection."""
    thread = channel._connecting
    if thread is not None:
        thread.join(5)
        channel._on_connected()


def test_calls_made_while_a_write_is_unanswered_wait_for_it_then_go_together(
    store: Store, hub: Hub, r: redis.Redis
) -> None:
    channel = PipelinedChannel(store, hub, hub.timer, timeout=2)
    calls = Calls(channel)
    calls.make(range(3))
    connected(channel)  # the connection is made off the loop; the loop then takes it
    channel._write()  # the loop's turn: the first three go out
    calls.make(range(3, 6))
    channel._write()  # the next turn, before the replies were read
    time.sleep(0.2)  # not only a wait: the later calls must stay unwritten meanwhile
    assert r.exists(key(0)) and not r.exists(key(3)), "the later calls were written early"
    channel._on_readable()  # the replies of the first write (all in by now)
    assert calls.answers == [(0, True), (1, True), (2, True)]
    channel._write()  # the next turn: the three that waited go out together
    time.sleep(0.2)  # their replies come in; one read takes them all
    channel._on_readable()
    assert calls.answers[3:] == [(3, True), (4, True), (5, True)]
    channel.close()


def test_an_urgent_call_is_written_at_the_next_turn_though_a_write_is_unanswered(
    store: Store, hub: Hub, r: redis.Redis
) -> None:
    """A gate ask made on a reserved pool slot: the process idles until the answer, so
    it does not wait for the replies of a write in flight (a release, say)."""
    channel = PipelinedChannel(store, hub, hub.timer, timeout=2)
    calls = Calls(channel)
    calls.make(range(20, 23))
    connected(channel)
    channel._write()
    calls.make(range(23, 24))  # waits, as above
    calls.make(range(24, 25), urgent=True)  # takes the one before it along
    channel._write()  # the next turn, before the replies were read
    wait_until(
        lambda: r.exists(key(23)) and r.exists(key(24)),
        2,
        "the urgent call and the one before it written (not waiting for the replies)",
    )
    calls.make(range(25, 26))  # not urgent: waits again
    channel._write()
    time.sleep(0.2)  # not a wait: it must stay unwritten meanwhile
    assert not r.exists(key(25))
    channel._on_readable()
    assert calls.answers == [(i, True) for i in range(20, 25)]
    channel._write()
    time.sleep(0.2)  # its reply comes in; one read takes it
    channel._on_readable()
    assert calls.answers[5:] == [(25, True)]
    channel.close()


def test_an_urgent_call_is_written_at_once_not_at_the_loops_next_turn(
    store: Store, hub: Hub, r: redis.Redis
) -> None:
    """The rest of the loop's turn (its other events, the timers, the transport's and
    the pool's own on_tick work) is not added to the idle process's wait: the ask goes
    out when it is made, with what was queued before it."""
    channel = PipelinedChannel(store, hub, hub.timer, timeout=2)
    calls = Calls(channel)
    calls.make(range(30, 31))
    connected(channel)  # writes what waited for the connection
    calls.make(range(31, 32))  # waits for the loop's turn
    time.sleep(0.2)  # not a wait: it must stay unwritten meanwhile
    assert not r.exists(key(31))
    calls.make(range(32, 33), urgent=True)  # no _write: the loop has not turned
    wait_until(
        lambda: r.exists(key(31)) and r.exists(key(32)),
        2,
        "the urgent call and the one queued before it written at once",
    )
    wait_until(lambda: (channel._on_readable(), len(calls.answers) == 3)[1], 2, "answered")
    assert calls.answers == [(30, True), (31, True), (32, True)]
    channel.close()


def test_flush_answers_calls_queued_behind_an_unanswered_write(store: Store, hub: Hub) -> None:
    """At shutdown the worker flushes: calls still queued behind a write in flight must
    be written and answered too, not left to time out."""
    channel = PipelinedChannel(store, hub, hub.timer, timeout=2)
    calls = Calls(channel)
    calls.make(range(10, 13))
    connected(channel)
    channel._write()
    calls.make(range(13, 16))
    started = time.monotonic()
    channel.flush()
    assert calls.answers == [(i, True) for i in range(10, 16)]
    assert time.monotonic() - started < 1.5, "flush waited for a reply never asked for"
    channel.close()


def test_calls_from_other_threads_are_answered_with_their_own_replies(
    store: Store, hub: Hub
) -> None:
    """Celery's threads pool ends a run on its own threads: releases made there while the
    loop makes its asks must each get their own reply (issue 34 §5: asks read a
    release's reply, ``'int' object is not subscriptable``)."""
    channel = PipelinedChannel(store, hub, hub.timer, timeout=2)
    calls = Calls(channel)
    released: list[Any] = []
    per_thread = 500
    asks = 1500

    def releases(t: int) -> None:
        for i in range(per_thread):
            keys, args = Release((key(10_000 + t),), f"x{t}|w|{i}").script_call("c")
            channel.call("release", keys, args, released.append)
            time.sleep(0.001)  # a run of the pool

    threads = [threading.Thread(target=releases, args=(t,)) for t in range(8)]
    loop = hub.create_loop()
    switch_every = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch as on a busy worker, not every 5 ms
    for thread in threads:
        thread.start()
    made = 0
    deadline = time.monotonic() + 30
    while (len(calls.answers) < asks or len(released) < 8 * per_thread) and (
        time.monotonic() < deadline
    ):
        if made < asks:
            calls.make(range(made, made + 1), urgent=True)  # (asks are)
            made += 1
        next(loop)
    for thread in threads:
        thread.join()
    sys.setswitchinterval(switch_every)
    channel.close()
    assert calls.answers[:asks] == [(i, True) for i in range(asks)]
    assert len(calls.answers) == asks
    assert released == [0] * (8 * per_thread)
