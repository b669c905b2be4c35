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
forgot its report, or when the gate refuses for a grace. On Redis Cluster those see only
the shards a worker reports to or asks, and the copy of a run is often judged by another
worker: so each worker also watches the masters of the slots its kept ends live on
(``shards``, asked once a second while it keeps any), and writes a slot's ends again as
soon as another master serves it, or the same master with another history (restarted
empty). The copy waits meanwhile: the promoted shard holds back the run lease of any
family it has an epoch for, for one ``lease_ttl`` from the first ask (gate.lua "E").

How long ends are kept: Sentinel skips a replica whose link to the master was down
longer than ten times ``down-after-milliseconds`` (plus the time the master has been
down), so the ends of that long; on other stores a minute (the worker passes it). At
most ``MAX_KEPT`` of them (the oldest go first; said once).

Writing an end again is harmless: a done marker set again, a slot's run merged again
(release.lua). Celery-free.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence

from celery_baton.core.gate import Release
from celery_baton.store.shards import ShardMaster, ShardMasters

logger = logging.getLogger("celery_baton.worker")

#: Ends kept at most (a few hundred bytes each).
MAX_KEPT = 200_000
#: Ends written per round trip when they are written again.
CHUNK = 1_000
#: Seconds between tries while the store does not answer yet.
RETRY_EVERY = 0.5
#: Seconds between two looks at who serves the slots of the kept ends (Cluster). A
#: promoted shard holds the copy's run lease back for a lease_ttl (8 s by default).
WATCH_EVERY = 1.0


class RecordedEnds:
    """``keep`` each recorded end; ``write_back`` them all when the store may have lost them.

    ``write`` sends a chunk of releases (``Gate.release_many``); ``keep_for`` is how long
    an end is kept (seconds); ``shards``, on Redis Cluster: who serves which slot, watched
    while ends are kept (a slot's ends written again when its master changed)."""

    def __init__(
        self,
        write: Callable[[Sequence[Release]], object],
        keep_for: float,
        shards: ShardMasters | None = None,
    ) -> None:
        self.write = write
        self.keep_for = keep_for
        self.shards = shards
        # (when kept, its slot on Cluster (0 elsewhere), the end)
        self._ends: deque[tuple[float, int, Release]] = deque()
        self._slots: dict[int, int] = {}  # slot -> ends kept there
        self._lock = threading.Lock()
        self._said_full = False
        self._writing: threading.Thread | None = None
        # Asked for while writing back: every end (all), or those of these slots.
        self._want_all = False
        self._want_slots: set[int] = set()
        self._why = ""
        self._watching = 0  # the process whose watch runs (a forked child has none)
        #: The master last seen serving each slot ends were kept on (kept after they go:
        #: a master replaced while none were kept is still seen when one is kept again).
        self.seen: dict[int, ShardMaster] = {}

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
        slot = self.shards.slot(end.done_key) if self.shards is not None else 0
        with self._lock:
            self._ends.append((now, slot, record))
            self._slots[slot] = self._slots.get(slot, 0) + 1
            self._prune(now)
        if self.shards is not None and self._watching != os.getpid():
            self._watching = os.getpid()
            threading.Thread(target=self._watch, name="baton-ends-shards", daemon=True).start()

    def _drop_oldest(self) -> None:
        _, slot, _ = self._ends.popleft()
        left = self._slots[slot] - 1
        if left:
            self._slots[slot] = left
        else:
            del self._slots[slot]

    def _prune(self, now: float) -> None:
        while self._ends and now - self._ends[0][0] > self.keep_for:
            self._drop_oldest()
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
                self._drop_oldest()

    def __len__(self) -> int:
        return len(self._ends)

    def write_back(
        self, why: str = "the store's master changed", slots: Collection[int] | None = None
    ) -> None:
        """The store may have lost its last writes (``why``, for the log): write every
        kept end again (or those on ``slots``, on Cluster), on a thread of its own, until
        it has them (or they are older than ``keep_for``)."""
        with self._lock:
            if not self._ends:
                return  # nothing recorded lately: nothing to write
            self._why = why
            if slots is None:
                self._want_all = True
            else:
                self._want_slots.update(slots)
            if self._writing is not None and self._writing.is_alive():
                return  # the thread takes what is asked now once it wrote the rest
            self._writing = threading.Thread(
                target=self._write_back, name="baton-ends-write-back", daemon=True
            )
            self._writing.start()

    def _write_back(self) -> None:
        while True:
            with self._lock:
                self._prune(time.monotonic())
                every, slots = self._want_all, self._want_slots
                self._want_all, self._want_slots = False, set()
                if not every and not slots:
                    self._writing = None
                    return
                ends = [end for _, slot, end in self._ends if every or slot in slots]
                why = self._why
            if self._write_all(ends):
                logger.warning(
                    "baton: %s: %d run end(s) recorded in the last %.0fs written again "
                    "(the store may have lost them)",
                    why,
                    len(ends),
                    self.keep_for,
                )

    def _watch(self) -> None:
        """Cluster: once a second while ends are kept, who serves their slots; a slot
        served by another master than last seen (or by the same one restarted with
        another history) has its ends written again."""
        assert self.shards is not None
        pid = self._watching
        while pid == os.getpid():
            time.sleep(WATCH_EVERY)
            with self._lock:
                self._prune(time.monotonic())
                slots = list(self._slots)
            if not slots:
                continue
            try:
                now = self.shards.masters(slots)
            except Exception:  # no node answers: ask again next time
                continue
            replaced = {
                slot: master
                for slot, master in now.items()
                if slot in self.seen and self.seen[slot].replaced_by(master)
            }
            for slot, master in now.items():
                self.seen[slot] = master
            if replaced:
                masters = ", ".join(sorted({m.address for m in replaced.values()}))
                self.write_back(f"a Cluster shard's master changed ({masters})", replaced)

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
