"""The wake pipe: a release noticed on another thread wakes a queue on the consumer's loop.

The notice listener runs in a thread of its own; held deliveries belong to the
consumer's event loop. A woken key is queued and one byte written to a pipe the loop
reads; the loop then calls ``on_release(key)`` for each key woken since. Without an
event loop (no hub) the consumer's timer, which is thread-safe, carries the call.
"""

from __future__ import annotations

import contextlib
import os
from collections import deque
from collections.abc import Callable
from typing import Any


class WakePipe:
    """Calls ``on_release(key)`` on the consumer's loop for a key ``send`` was given."""

    def __init__(self, consumer: Any, on_release: Callable[[str], None]) -> None:
        self.consumer = consumer
        self.on_release = on_release
        self._keys: deque[str] = deque()
        self._write_fd: int | None = None
        self._fds: tuple[int, int] | None = None

    def install(self, consumer: Any) -> None:
        """Register on ``consumer``'s loop, closing the pipe of an earlier loop."""
        self.consumer = consumer
        hub = getattr(consumer, "hub", None)
        old, self._fds = self._fds, None
        if old is not None:
            if hub is not None:
                with contextlib.suppress(Exception):  # gone already if the loop was reset
                    hub.remove_reader(old[0])
            for fd in old:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._write_fd = None
        if hub is not None:
            r, w = os.pipe()
            os.set_blocking(r, False)
            os.set_blocking(w, False)
            self._fds = (r, w)
            self._write_fd = w
            hub.add_reader(r, self._on_readable, r)

    def send(self, key: str) -> None:
        """Called from another thread: ``key`` was released."""
        if self._write_fd is not None:
            self._keys.append(key)
            with contextlib.suppress(BlockingIOError):
                os.write(self._write_fd, b"!")
        else:  # timer2 runs its own thread and is thread-safe
            self.consumer.timer.call_after(0, self.on_release, (key,))

    def _on_readable(self, fd: int) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(fd, 4096)
        keys = set()
        while self._keys:
            keys.add(self._keys.popleft())
        for key in keys:
            self.on_release(key)
