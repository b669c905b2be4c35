"""The task ids a worker was told are cancelled, readable by every process it forks.

A plain call (one that asks the store nothing) is screened for a cancel when its worker
receives it; then it may wait in the worker for a pool process (prefork's outbound
buffer, the threads pool's queue, a green pool full), seconds on a busy pool, and a
``baton.cancel`` made meanwhile must still keep its body from starting (issue 38:
"wherever its message is"). The worker's main process hears of each cancel by id on the
store's notice channel; it writes the id here, and whatever starts a job (a pool
process before it accepts it, the executor thread or greenlet before the body) looks it
up in memory: no store call for a call that nobody cancelled.

A cancel *by key* is matched by the main process (it holds the task's key cancels and
the calls it received): when it learns of one, it matches the calls it holds (those
waiting for a pool process among them) and writes each covered id here with the moment
its cancel ends (``add(task_id, until=...)``). Whatever starts the job trusts that
match until then, as the worker trusts the same match at a call's receipt: no store
call, and nothing to match (no arguments decoded) where the job starts.

The notices are heard on one connection, and a worker can miss them for a while: the
whole worker stood still (stopped, swapped out, starved), or the connection was lost
and is being made again (the store restarted, a failover, the server dropped it). So the
listener also writes here when it last had every notice applied (:meth:`heard`); a job
that starts while that is older than a bound asks the store itself
(worker/pool/cancel_start.py).

A table of fixed slots in an anonymous shared mapping made before the pool forks (every
pool process, recycled ones included, inherits it). An id's slot is chosen by its
digest; a later id in the same slot overwrites an earlier one, which then goes
unnoticed here (its call starts as before this table: the loss of a collision is a
start that was screened only at receipt). A hit of an id noticed by id is a hint,
confirmed in the store by the caller before anything is refused. Celery-free.
"""

from __future__ import annotations

import mmap
import struct

_DIGEST = 8
#: A slot: the id's digest, then until when a match by key holds (``time.monotonic()``;
#: 0.0 for an id noticed by id). CLOCK_MONOTONIC is the machine's, not the process's:
#: every process forked from the worker reads the same clock.
_UNTIL = struct.Struct("<d")
_SLOT = _DIGEST + _UNTIL.size
#: Slots (16 bytes each): far more than the cancels noticed within a message's life on
#: one worker, so that two of them rarely share a slot.
SLOTS = 1 << 15


class SharedCancels:
    """Ids noticed cancelled, written by the worker's main process (make it there
    before the pool forks), read by any process or thread that starts a job."""

    def __init__(self, slots: int = SLOTS) -> None:
        self.slots = slots
        # fileno -1: anonymous; MAP_SHARED is mmap's default, so forked processes read
        # the pages the main process writes.
        self._table = mmap.mmap(-1, slots * _SLOT)
        self._heard = mmap.mmap(-1, _UNTIL.size)  # 0.0: not yet heard at all

    def heard(self, at: float) -> None:
        """Main process (the notice listener): every notice sent before ``at``
        (``time.monotonic()``) was applied here, or found by a read of the store."""
        _UNTIL.pack_into(self._heard, 0, at)

    def unheard_for(self, now: float) -> float:
        """Seconds since the notices were last all applied; 0.0 before they ever were (a
        worker starting: it read the store's cancels as it started)."""
        at = float(_UNTIL.unpack_from(self._heard, 0)[0])
        return 0.0 if at == 0.0 else now - at

    def _where(self, task_id: str) -> tuple[int, bytes]:
        # Python's own str hash: the same in every process forked from the one that made
        # the table (the seed is chosen at the interpreter's start), cached on the
        # string. 0 marks an empty slot, so a digest of 0 is taken as 1.
        value = (hash(task_id) & 0xFFFF_FFFF_FFFF_FFFF) or 1
        return value % self.slots * _SLOT, value.to_bytes(_DIGEST, "little")

    def add(self, task_id: str, *, until: float = 0.0) -> None:
        """Main process: ``task_id`` noticed cancelled by id (``until`` 0.0: a hint), or
        matched by a key cancel that lives until ``until`` (``time.monotonic()``)."""
        at, digest = self._where(task_id)
        # The end before the digest (stores are seen in order on x86; elsewhere a reader
        # racing the write may miss it, as a call screened just before the notice).
        _UNTIL.pack_into(self._table, at + _DIGEST, until)
        self._table[at : at + _DIGEST] = digest

    def find(self, task_id: str) -> float | None:
        """None when ``task_id`` was not noticed; 0.0 when noticed by id (a hint:
        confirm it in the store); else until when the worker's match by key holds."""
        at, digest = self._where(task_id)
        if self._table[at : at + _DIGEST] != digest:
            return None
        return float(_UNTIL.unpack_from(self._table, at + _DIGEST)[0])

    def has(self, task_id: str) -> bool:
        """Whether ``task_id`` was noticed cancelled (by id or matched by key)."""
        return self.find(task_id) is not None
