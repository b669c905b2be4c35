"""The loop door: a call made on another thread runs on the consumer's loop thread.

What a run's end touches (the gate channel, whose replies are matched to its calls by
their order; the consumer's timer, a heap; the admitted requests; Celery's ``call_soon``
before kombu 5.7) belongs to the consumer's event loop and assumes one thread. Celery's
threads pool calls a request's ``on_success`` and ``on_failure`` from its executor
threads, so a run's end is handed over here: queued, one byte written to a pipe the
loop reads, and run there in order. On the loop thread itself (prefork's result
handler, solo), without a loop (gevent, eventlet: one thread), or once the door is
closed at shutdown (the loop no longer turns), a call runs at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("celery_baton.worker")


class LoopDoor:
    """``run(call)``: on the loop thread now, or from another thread, at the loop's next
    turn (it is woken for it)."""

    def __init__(self) -> None:
        self._calls: deque[Callable[[], None]] = deque()
        self._hub: Any = None
        self._fds: tuple[int, int] | None = None
        self._loop_thread: int | None = None

    def install(self, consumer: Any) -> None:
        """On the loop thread, at every consumer start (after a lost broker connection
        Celery resets the loop, which drops every file descriptor registered on it)."""
        self.close()
        hub = getattr(consumer, "hub", None)
        if hub is None:
            return
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        self._fds = (r, w)
        self._hub = hub
        self._loop_thread = threading.get_ident()
        hub.add_reader(r, self._on_readable)

    def on_loop_thread(self) -> bool:
        return self._fds is None or threading.get_ident() == self._loop_thread

    def run(self, call: Callable[[], None]) -> None:
        fds = self._fds
        if fds is None or threading.get_ident() == self._loop_thread:
            call()
            return
        self._calls.append(call)
        with contextlib.suppress(OSError):  # full: the loop is woken already; closed: below
            os.write(fds[1], b"!")
        if self._fds is None:  # closed meanwhile: nobody will read the queue
            self._run_queued()

    def _on_readable(self, *args: Any) -> None:
        fds = self._fds
        if fds is not None:
            with contextlib.suppress(OSError):
                os.read(fds[0], 4096)
        self._run_queued()

    def _run_queued(self) -> None:
        while True:
            try:
                call = self._calls.popleft()
            except IndexError:
                return
            try:
                call()
            except Exception:  # the loop would only log it: go on with the others
                logger.exception("baton: a run's end handed to the loop failed")

    def close(self) -> None:
        """The loop stops (or was reset): what is queued runs now; later calls at once."""
        fds, self._fds = self._fds, None
        if fds is not None:
            with contextlib.suppress(Exception):  # gone already if the loop was reset
                self._hub.remove_reader(fds[0])
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._hub = None
        self._run_queued()
