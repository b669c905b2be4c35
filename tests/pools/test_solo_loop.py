"""Solo runs each body on the worker's event loop, which reads no reply while a body
runs: a call to the store sent just before a long body (a lease's release, the next
call's ask) is answered meanwhile, and must be read as answered, not taken for a store
that is down.

A real worker and a store kept busy for moments (a Lua script holds it 0.3 s in every
0.5 s: a slow command, a fork for a snapshot), so that a reply comes back just after the
next body started.
"""

from __future__ import annotations

import threading

import pytest

from tests.support.observer import Observer
from tests.support.servers import StoreServer
from tests.support.waiting import wait_until
from tests.support.workers import Workers

#: A Lua script that keeps the server busy (it answers no one) for ARGV[1] ms.
SPIN = """
local t = redis.call('TIME')
local until_us = t[1] * 1000000 + t[2] + ARGV[1] * 1000
repeat t = redis.call('TIME') until t[1] * 1000000 + t[2] >= until_us
return 1
"""


class BusyServer:
    """Keeps ``server`` busy ``busy_ms`` in every ``busy_ms`` + ``gap_s`` while entered."""

    def __init__(self, server: StoreServer, busy_ms: int = 300, gap_s: float = 0.2) -> None:
        self.server, self.busy_ms, self.gap_s = server, busy_ms, gap_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with self.server.client() as client:
            spin = client.register_script(SPIN)
            while not self._stop.wait(self.gap_s):
                spin(args=[self.busy_ms])

    def __enter__(self) -> BusyServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


@pytest.mark.timeout(120)
def test_store_replies_that_came_while_long_bodies_ran_on_solos_loop_are_not_lost(
    workers: Workers, observer: Observer, store_server: StoreServer
) -> None:
    """Exclusive calls between plain bodies of 2.5 s (over the store's 2 s
    ``socket_timeout``) on solo, the store busy for moments: a lease's release or an
    ask sent just before a plain body started was answered while the body ran. It must
    not be taken for a store that does not answer (it was: "store unavailable" logged,
    every call in flight answered so, the waiting calls held for the store and new
    asks refused for a while)."""
    from tests.apps import busy_pool

    worker = workers.start("tests.apps.busy_pool", pool="solo")
    sent = []
    with BusyServer(store_server):
        for _ in range(5):
            sent.append(busy_pool.one_at_a_time.delay(0.05).id)
            sent.append(busy_pool.occupy.delay(2.5).id)
        wait_until(lambda: {s["task_id"] for s in observer.started()} >= set(sent), 90, "every run")
    assert "store unavailable" not in worker.log_text()
