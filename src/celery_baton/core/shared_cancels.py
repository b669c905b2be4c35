"""The task ids a worker was told are cancelled, readable by every process it forks.

A plain call (one that asks the store nothing) is screened for a cancel when its worker
receives it; then it may wait in the worker for a pool process (prefork's outbound
buffer, the threads pool's queue, a green pool full), seconds on a busy pool, and a
``baton.cancel`` made meanwhile must still keep its body from starting (issue 38:
"wherever its message is"). The worker's main process hears of each cancel by id on the
store's notice channel; it writes the id here, and whatever starts a job (a pool
process before it accepts it, the executor thread or greenlet before the body) looks it
up in memory: no store call for a call that nobody cancelled.

A table of fixed slots in an anonymous shared mapping made before the pool forks (every
pool process, recycled ones included, inherits it). An id's slot is chosen by its
digest; a later id in the same slot overwrites an earlier one, which then goes
unnoticed here (its call starts as before this table: the loss of a collision is a
start that was screened only at receipt). A hit is a hint, confirmed in the store by
the caller before anything is refused. Celery-free.
"""

from __future__ import annotations

import mmap

_DIGEST = 8
#: Slots (8 bytes each): far more than the cancels noticed within a message's life on
#: one worker, so that two of them rarely share a slot.
SLOTS = 1 << 15


class SharedCancels:
    """Ids noticed cancelled, written by the worker's main process (make it there
    before the pool forks), read by any process or thread that starts a job."""

    def __init__(self, slots: int = SLOTS) -> None:
        self.slots = slots
        # fileno -1: anonymous; MAP_SHARED is mmap's default, so forked processes read
        # the pages the main process writes.
        self._table = mmap.mmap(-1, slots * _DIGEST)

    def _where(self, task_id: str) -> tuple[int, bytes]:
        # Python's own str hash: the same in every process forked from the one that made
        # the table (the seed is chosen at the interpreter's start), cached on the
        # string. 0 marks an empty slot, so a digest of 0 is taken as 1.
        value = (hash(task_id) & 0xFFFF_FFFF_FFFF_FFFF) or 1
        return value % self.slots * _DIGEST, value.to_bytes(_DIGEST, "little")

    def add(self, task_id: str) -> None:
        at, digest = self._where(task_id)
        self._table[at : at + _DIGEST] = digest

    def has(self, task_id: str) -> bool:
        """Whether ``task_id`` was noticed cancelled (a hint: confirm it in the store)."""
        at, digest = self._where(task_id)
        return self._table[at : at + _DIGEST] == digest
