"""The loop door: a run's end reported on another thread runs on the loop's thread."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from kombu.asynchronous import Hub

from celery_baton.worker.loop_door import LoopDoor


def test_a_call_from_another_thread_runs_on_the_loop_in_order() -> None:
    hub = Hub()
    door = LoopDoor()
    door.install(SimpleNamespace(hub=hub))
    ran: list[tuple[int, int]] = []
    loop_thread = threading.get_ident()

    def from_pool_thread() -> None:
        assert not door.on_loop_thread()
        for i in range(50):
            door.run(lambda i=i: ran.append((i, threading.get_ident())))

    thread = threading.Thread(target=from_pool_thread)
    thread.start()
    thread.join()
    assert ran == []  # queued until the loop turns
    loop = hub.create_loop()
    deadline = time.monotonic() + 5
    while len(ran) < 50 and time.monotonic() < deadline:
        next(loop)
    assert ran == [(i, loop_thread) for i in range(50)]
    door.close()
    hub.close()


def test_on_the_loop_thread_without_a_loop_or_once_closed_a_call_runs_at_once() -> None:
    ran: list[int] = []
    door = LoopDoor()
    door.install(SimpleNamespace(hub=None))  # gevent, eventlet: no loop, one thread
    door.run(lambda: ran.append(1))
    hub = Hub()
    door.install(SimpleNamespace(hub=hub))
    door.run(lambda: ran.append(2))  # on the loop's thread
    door.close()  # at shutdown
    thread = threading.Thread(target=lambda: door.run(lambda: ran.append(3)))
    thread.start()
    thread.join()
    assert ran == [1, 2, 3]
    hub.close()
