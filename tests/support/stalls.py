"""Notice when this machine stops running processes for a while.

A shared virtual machine sometimes runs none of its processes for half a second or more
(the host gives the CPUs to someone else). Every worker stops at once, so a rate-limited
backlog loses the slots of that time, through no fault of the code under test. A
``StallWatch`` thread asks to sleep for ``tick`` seconds, over and over, and records
every time it woke ``threshold`` seconds or more late: the test can then tell a slow
library from a machine that stood still, and say which it was.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Stall:
    start_us: int  # wall clock (the same clock as the local servers' TIME)
    length_us: int


class StallWatch:
    def __init__(self, tick: float = 0.01, threshold: float = 0.1) -> None:
        self.tick = tick
        self.threshold = threshold
        self.stalls: list[Stall] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="stall-watch", daemon=True)

    def __enter__(self) -> StallWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.is_set():
            before = time.time()
            time.sleep(self.tick)
            late = time.time() - before - self.tick
            if late >= self.threshold:
                self.stalls.append(Stall(int(before * 1_000_000), int(late * 1_000_000)))

    def stalled_us(self, start_us: int, end_us: int) -> int:
        """How long the machine stood still within ``[start_us, end_us]``."""
        total = 0
        for stall in self.stalls:
            begin = max(stall.start_us, start_us)
            end = min(stall.start_us + stall.length_us, end_us)
            total += max(0, end - begin)
        return total
