"""Which runs' ends their own process recorded in the store, told to the worker's main
process without a round trip.

A run's end is recorded in the store by the process that ran it, before its result is
seen (``worker/pool/run_end.py``: its leases freed, its done marker, its unique claim).
The main process learns of the end later, and used to record the same again, to be sure
(the pool process may have found the store down): one more script call per guarded run,
a third of a guarded drain's store calls and a measurable part of its speed (issue 36).
And between the two, the main process's lease renewer could read the freed lease as
lost.

So the run's process says here what it did: ``ENDING`` before it sends the record,
``RECORDED`` once the store answered. The main process sends its own record only when
the run's was not recorded (a process that died, a store that did not answer), and its
renewer takes a lease gone under a run that is ``ENDING`` or ``RECORDED`` for that run's
own release, not a loss.

A table of fixed slots in memory shared by every process the worker forks (an anonymous
shared mapping made before the pool starts, so that every pool process, recycled ones
included, inherits it). A run's slot is chosen by a digest of its owner; two runs whose
owners share a slot overwrite each other: the main process then finds no record of its
run and records the end itself, as before, so a collision costs a call, never an end.
Celery-free.
"""

from __future__ import annotations

import mmap

#: Nothing known of the owner in its slot.
UNKNOWN = 0
#: Its process is sending the record of its end (a gone lease is its own release).
ENDING = 1
#: The store answered: the end is recorded, the main process need not record it again.
RECORDED = 2

_DIGEST = 8
_SLOT = _DIGEST + 1
#: Slots in the table (9 bytes each): far more than the runs that end at once on one
#: worker, so that two of them rarely share a slot.
SLOTS = 1 << 14


class SharedEnds:
    """``ENDING``/``RECORDED`` per run owner, written by the run's process, read by the
    worker's main process (make it there before the pool forks)."""

    def __init__(self, slots: int = SLOTS) -> None:
        self.slots = slots
        # fileno -1: anonymous; MAP_SHARED is mmap's default, so forked processes write
        # into the same pages.
        self._table = mmap.mmap(-1, slots * _SLOT)

    def _where(self, owner: str) -> tuple[int, bytes]:
        # Python's own str hash: the same in every process forked from the one that
        # made the table (the hash seed is chosen at the interpreter's start), cached on
        # the string, and 64 bits wide: two owners alike by chance are out of reach.
        value = hash(owner) & 0xFFFF_FFFF_FFFF_FFFF
        return value % self.slots * _SLOT, value.to_bytes(_DIGEST, "little")

    def set(self, owner: str, state: int) -> None:
        at, digest = self._where(owner)
        # The state byte first as UNKNOWN: a reader that races this write finds no
        # match rather than another owner's state under this owner's digest.
        self._table[at + _DIGEST] = UNKNOWN
        self._table[at : at + _DIGEST] = digest
        self._table[at + _DIGEST] = state

    def state(self, owner: str) -> int:
        at, digest = self._where(owner)
        if self._table[at : at + _DIGEST] != digest:
            return UNKNOWN
        return self._table[at + _DIGEST]

    def ending(self, owner: str) -> bool:
        """Its process is recording its end, or did: a lease gone is its own release."""
        return self.state(owner) in (ENDING, RECORDED)

    def recorded(self, owner: str) -> bool:
        return self.state(owner) == RECORDED
