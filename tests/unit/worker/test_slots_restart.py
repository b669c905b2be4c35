"""What the pool slots and a terminated run's end keep on the consumer's timer is armed
again at a consumer restart: Celery 5.3 clears that timer when the broker connection is
lost (``Consumer.on_close``: ``self.timer.clear()``), Celery 5.6 and 5.7 keep it. With a
real kombu timer, both ways (the same model as the reserved rate slot's give-back,
tests/unit/worker/test_starting.py, found by tests/transport/test_held_broker_kill.py on
Celery 5.3)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from celery.worker import state as worker_state
from kombu.asynchronous.semaphore import LaxBoundedSemaphore
from kombu.asynchronous.timer import Timer

from celery_baton.worker.pool_slots import CountedSlots, SemaphoreSlots
from celery_baton.worker.releasing import Releasing


class _Request:
    """A request as Celery's worker state keeps it (weakly)."""


def _fire_all(timer: Timer) -> None:
    """Run every entry the timer holds now (as the loop would once they are due)."""
    for item in timer.queue:
        if not item.entry.canceled:
            item.entry()


def _live(timer: Timer, fun: Any) -> int:
    return sum(1 for i in timer.queue if not i.entry.canceled and i.entry.fun == fun)


@pytest.mark.parametrize("cleared", [True, False], ids=["celery5.3", "celery5.6+"])
def test_a_request_waiting_for_a_counted_slot_is_served_after_a_restart(cleared: bool) -> None:
    """Before: the armed poll went with the cleared timer and its flag stayed up, so a
    slot that Celery freed (a run that ended) was never seen, and the waiter waited for
    good (threads, gevent, eventlet, solo)."""
    timer = Timer()
    running = _Request()
    worker_state.reserved_requests.add(running)  # type: ignore[arg-type]
    try:
        served: list[str] = []
        slots = CountedSlots(1, lambda request: None, timer)
        slots.plain(running)  # the pool's one slot runs it
        slots.acquire(lambda: served.append("waiter"))
        assert served == []
        if cleared:
            timer.clear()
        worker_state.reserved_requests.discard(running)  # type: ignore[arg-type]
        slots.restart()
        assert _live(timer, slots._on_poll) == 1  # once, also where the timer was kept
        _fire_all(timer)
        assert served == ["waiter"]
    finally:
        worker_state.reserved_requests.discard(running)  # type: ignore[arg-type]


@pytest.mark.parametrize("cleared", [True, False], ids=["celery5.3", "celery5.6+"])
def test_the_stuck_wait_check_lives_on_after_a_restart(cleared: bool) -> None:
    """Before: registered once at the pool's start, gone with a cleared timer: a pool that
    stalled after a reconnect was never said."""
    timer = Timer()
    slots = SemaphoreSlots(LaxBoundedSemaphore(1), lambda r: None, lambda r: None, timer)
    looked: list[int] = []
    slots._look_for_a_stuck_wait = lambda: looked.append(1)  # type: ignore[method-assign]
    pool = SimpleNamespace(startable=lambda: 1, on_change=None)
    slots.attach(SimpleNamespace(_pool=pool))
    if cleared:
        timer.clear()
    slots.restart()
    _fire_all(timer)
    assert looked == [1]  # looked for again, and once where the timer was kept


@pytest.mark.parametrize("cleared", [True, False], ids=["celery5.3", "celery5.6+"])
def test_a_terminated_run_is_checked_again_after_a_restart(cleared: bool) -> None:
    """Before: the next check of a terminated run (its body still running) went with a
    cleared timer, and its leases, renewed meanwhile, were kept for good."""
    timer = Timer()
    releasing = Releasing(book=None, timer=timer, unsent=SimpleNamespace(restart=lambda t: None))  # type: ignore[arg-type]
    finished: list[Any] = []
    releasing.finish = lambda *a, **k: finished.append(a)  # type: ignore[method-assign]
    body_runs = [True]
    releasing.finish_when_ended(
        lambda: not body_runs[0],
        "its process",
        SimpleNamespace(name="t", id="1"),
        None,
        None,
        final=True,  # type: ignore[arg-type]
    )
    assert finished == []
    if cleared:
        timer.clear()
    body_runs[0] = False  # the body ended meanwhile
    releasing.restart(timer)
    _fire_all(timer)
    assert len(finished) == 1
