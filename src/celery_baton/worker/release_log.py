"""The consumer's memory of announced releases: bounded, O(1) amortised per notice."""

from __future__ import annotations

import time
from collections import OrderedDict

#: How long a release is remembered: a denial may still be on its way back to the loop
#: while the release that follows it is already announced.
REMEMBER_RELEASES = 10.0


class ReleaseLog:
    """When each lease key's release was last announced, remembered for ``memory`` s.

    A denial can be on its way back to the loop while the release that follows it is
    already announced; the log lets the denied request retry at once instead of
    sleeping through a notice it missed. Written by the notice listener thread, read on
    the loop (single dict operations, atomic under the GIL). Keys are kept in the order
    they were noted, a key noted again moving to the end, so the oldest are always at
    the front: expiry pops from there, O(1) amortised per notice however many keys are
    released. ``most`` bounds memory when notices come faster than ``memory`` expires.
    """

    def __init__(self, memory: float = REMEMBER_RELEASES, most: int = 65536) -> None:
        self.memory = memory
        self.most = most
        self._at: OrderedDict[str, float] = OrderedDict()

    def note(self, key: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        at = self._at
        at[key] = now
        at.move_to_end(key)
        horizon = now - self.memory
        while at:
            oldest = next(iter(at.values()))
            if oldest > horizon and len(at) <= self.most:
                break
            at.popitem(last=False)

    def at(self, key: str) -> float:
        """When ``key``'s release was last announced (monotonic; -1.0: not lately)."""
        return self._at.get(key, -1.0)

    def __len__(self) -> int:
        return len(self._at)
