"""SemaphoreSlots: a request given Celery's semaphore asks only once the pool counts a
process that can start it now (worker/pool_slots.py; the pool's count: pool/prefork.py,
driven by real workers in tests/limits/test_recycled_pool.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from celery.worker import state as worker_state
from kombu.asynchronous.semaphore import LaxBoundedSemaphore

from celery_baton.worker.pool_slots import SemaphoreSlots


class Pool:
    """A started pool as SemaphoreSlots sees it: how many processes can start a job."""

    def __init__(self, startable: int) -> None:
        self.free = startable
        self.on_change: Any = None

    def startable(self) -> int:
        return self.free


def slots(size: int) -> tuple[SemaphoreSlots, list[Any]]:
    handed: list[Any] = []
    return SemaphoreSlots(LaxBoundedSemaphore(size), handed.append, handed.append), handed


def test_without_the_pools_count_the_semaphore_alone_decides() -> None:
    s, _ = slots(1)
    asked: list[int] = []
    s.acquire(lambda: asked.append(1))
    s.acquire(lambda: asked.append(2))
    assert asked == [1]
    s.give_back()
    assert asked == [1, 2]


def test_a_request_given_the_semaphore_waits_for_a_process_that_can_start_it() -> None:
    s, handed = slots(2)
    pool = Pool(startable=0)  # the only process is leaving
    s.attach(SimpleNamespace(_pool=pool))
    asked: list[int] = []
    s.acquire(lambda: asked.append(1))
    s.acquire(lambda: asked.append(2))  # Celery's second release of the same slot
    assert asked == []
    pool.free = 1  # the replacement is up
    pool.on_change()
    assert asked == [1]  # one process: one request asks, the other waits
    s.run("request-1")
    pool.free = 0  # it is busy now
    pool.on_change()
    assert asked == [1] and handed == ["request-1"]
    pool.free = 1
    pool.on_change()
    assert asked == [1, 2]


def test_a_slot_given_back_goes_to_the_next_waiter_when_a_process_is_free() -> None:
    s, _ = slots(1)
    pool = Pool(startable=1)
    s.attach(SimpleNamespace(_pool=pool))
    asked: list[int] = []
    s.acquire(lambda: asked.append(1))
    s.acquire(lambda: asked.append(2))
    assert asked == [1]
    s.give_back()  # the gate refused 1 for now: 2 asks on the same process
    assert asked == [1, 2]


class _Request:
    """A request as Celery reserved it (``worker.state.reserved_requests`` holds it
    weakly)."""

    def __init__(self, name: str) -> None:
        self.name, self.id = "t", name


def _request(name: str) -> _Request:
    request = _Request(name)
    worker_state.reserved_requests.add(request)
    return request


def test_a_plain_request_waits_in_the_same_line_for_a_process() -> None:
    s, handed = slots(2)
    pool = Pool(startable=0)
    s.attach(SimpleNamespace(_pool=pool))
    asked: list[int] = []
    plain, granted = _request("plain"), _request("granted")
    try:
        s.acquire(lambda: asked.append(1))  # guarded, first in line
        s.plain(plain)  # given the semaphore's second slot: no process for it either
        assert asked == [] and handed == []
        pool.free = 1
        pool.on_change()
        assert asked == [1] and handed == []  # the first in line asks; the plain one waits
        s.run(granted)
        pool.free = 1  # another process came up
        pool.on_change()
        assert handed == [granted, plain]
    finally:
        worker_state.reserved_requests.discard(plain)
        worker_state.reserved_requests.discard(granted)


def test_a_waiting_request_celery_dropped_is_not_handed_over() -> None:
    """A lost broker connection empties Celery's reserved requests (their messages come
    back from the broker): one still in the line is left, its slot given to the next."""
    s, handed = slots(1)
    pool = Pool(startable=0)
    s.attach(SimpleNamespace(_pool=pool))
    dropped = _request("dropped")
    s.plain(dropped)
    worker_state.reserved_requests.discard(dropped)  # Consumer.on_close
    kept = _request("kept")
    try:
        s.plain(kept)  # waits for the semaphore the dropped one holds
        pool.free = 1
        pool.on_change()
        assert handed == [kept]
    finally:
        worker_state.reserved_requests.discard(kept)
