"""The hot path's own store connection (``wire.py``), against a real server.

On a plain socket ``Wire`` writes and reads the file descriptor directly (a socket with
a timeout would poll before every call); these check the two edges of that: a write the
kernel cannot take at once, and an event loop's read when nothing has arrived.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis

from celery_baton.store.connection import Store, connect
from celery_baton.wire import Wire, pooled_connection


@pytest.fixture
def wire(store_url: str) -> Iterator[Wire]:
    store: Store = connect(store_url, socket_timeout=2)
    wire = Wire(pooled_connection(store.client.connection_pool))
    yield wire
    wire.close()
    store.client.close()


def test_a_write_larger_than_the_socket_buffer_goes_out_whole(wire: Wire) -> None:
    value = b"x" * (16 * 1024 * 1024)  # far more than a loopback socket takes at once
    wire.send(("SET", "big", value), ("STRLEN", "big"))
    assert wire.read() in ("OK", b"OK")
    assert wire.read() == len(value)


def test_many_commands_in_one_write_are_answered_in_order(wire: Wire) -> None:
    wire.send(*[("INCR", "n") for _ in range(1000)])
    assert [wire.read() for _ in range(1000)] == list(range(1, 1001))


def test_read_ready_with_nothing_arrived_returns_at_once(wire: Wire) -> None:
    # An event loop calls read_ready when its poller says readable; if nothing is there
    # after all, the loop must not wait (the socket's timeout is 2 s) nor lose the wire.
    started = time.monotonic()
    assert wire.read_ready() == []
    assert time.monotonic() - started < 0.5
    wire.send(("PING",))
    deadline = time.monotonic() + 2
    replies: list[object] = []
    while not replies and time.monotonic() < deadline:
        replies = wire.read_ready()
    assert replies in (["PONG"], [b"PONG"])


def test_a_closed_connection_is_reported_by_read_ready(wire: Wire, store_url: str) -> None:
    store = connect(store_url, socket_timeout=2)
    try:
        store.client.client_kill_filter(skipme=True)  # every other client: the wire's
    finally:
        store.client.close()
    deadline = time.monotonic() + 2
    with pytest.raises(redis.ConnectionError):
        while time.monotonic() < deadline:
            wire.read_ready()
            time.sleep(0.01)
