"""The ends a worker recorded lately, written again when the store may have lost them.

A run's end is recorded in the store (the redelivery guard's done marker, a beat slot's
run record: ``Release.done_key``): a copy of its message is acked without running. A
Sentinel master acknowledges a write before its replicas have it, and the sentinels may
promote a replica that was behind: the record is gone, and the copy runs a second time.
Seen: a beat slot ran twice when the master was SIGKILLed; the leader's "sent" mark
was lost with the same master, so it sent the slot again.

Leases have their answer already (the new master holds every new lease for one
``lease_ttl`` while holders write theirs back); ends get the same: each worker keeps the
ends it recorded within the time a promoted replica can have been behind, and writes
them again as soon as it sees a new master. The copy waits meanwhile: it needs its run
lease, which the new master does not grant during its grace.

The same holds for any store that forgets (restarted without its data, a Cluster
shard's replica promoted): the worker writes its ends again when it sees that the store
forgot its report, or when the gate refuses for a grace.

How long ends are kept: Sentinel skips a replica whose link to the master was down
longer than ten times ``down-after-milliseconds`` (plus the time the master has been
down), so the ends of that long; on other stores a minute (the worker passes it). At
most ``MAX_KEPT`` of them (the oldest go first; said once).

Writing an end again is harmless: a done marker set again, a slot's run merged again
(release.lua). Celery-free.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

from celery_baton.core.gate import Release

logger = logging.getLogger("celery_baton.worker")

#: Ends kept at most (a few hundred bytes each).
MAX_KEPT = 200_000
#: Ends written per round trip when they are written again.
CHUNK = 1_000
#: Seconds between tries while the store does not answer yet.
RETRY_EVERY = 0.5


class RecordedEnds:
    """``keep`` each recorded end; ``write_back`` them all when the store may have lost them.

    ``write`` sends a chunk of releases (``Gate.release_many``); ``keep_for`` is how long
    an end is kept (seconds)."""

    def __init__(self, write: Callable[[Sequence[Release]], object], keep_for: float) -> None:
        self.write = write
        self.keep_for = keep_for
        self._ends: deque[tuple[float, Release]] = deque()
        self._lock = threading.Lock()
        self._said_full = False
        self._writing: threading.Thread | None = None
        self._again = False  # asked again while writing back: everything once more
        self._why = ""

    def keep(self, end: Release) -> None:
        """An end just recorded (only its record is kept: leases and claims are not
        given back twice)."""
        if not end.done_key:
            return
        record = Release(
            (),
            end.owner,
            end.done_key,
            end.done_ttl,
            done_stamp=end.done_stamp,
            done_link=end.done_link,
        )
        now = time.monotonic()
        with self._lock:
            self._ends.append((now, record))
            self._prune(now)

    def _prune(self, now: float) -> None:
        while self._ends and now - self._ends[0][0] > self.keep_for:
            self._ends.popleft()
        if len(self._ends) > MAX_KEPT:
            if not self._said_full:
                self._said_full = True
                logger.warning(
                    "baton: more than %d run ends recorded in %.0fs: only the last %d are "
                    "written again if the store loses them",
                    MAX_KEPT,
                    self.keep_for,
                    MAX_KEPT,
                )
            while len(self._ends) > MAX_KEPT:
                self._ends.popleft()

    def __len__(self) -> int:
        return len(self._ends)

    def write_back(self, why: str = "the store's master changed") -> None:
        """The store may have lost its last writes (``why``, for the log): write every
        kept end again, on a thread of its own, until it has them (or they are older
        than ``keep_for``)."""
        with self._lock:
            if not self._ends:
                return  # nothing recorded lately: nothing to write
            self._why = why
            if self._writing is not None and self._writing.is_alive():
                self._again = True  # the thread writes everything once more
                return
            self._writing = threading.Thread(
                target=self._write_back, name="baton-ends-write-back", daemon=True
            )
            self._writing.start()

    def _write_back(self) -> None:
        while True:
            with self._lock:
                self._again = False
                self._prune(time.monotonic())
                ends = [end for _, end in self._ends]
            written = self._write_all(ends)
            with self._lock:
                if not self._again:
                    if written:
                        logger.warning(
                            "baton: %s: %d run end(s) recorded in the last %.0fs written "
                            "again (the store may have lost them)",
                            self._why,
                            len(ends),
                            self.keep_for,
                        )
                    return

    def _write_all(self, ends: list[Release]) -> bool:
        deadline = time.monotonic() + self.keep_for
        start = 0
        while start < len(ends):
            try:
                self.write(ends[start : start + CHUNK])
                start += CHUNK
            except Exception as exc:
                if time.monotonic() > deadline:
                    logger.error(
                        "baton: %d run end(s) could not be written again to the store: %s; "
                        "a copy of those runs may run again",
                        len(ends) - start,
                        exc,
                    )
                    return False
                time.sleep(RETRY_EVERY)
        return bool(ends)
