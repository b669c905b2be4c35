"""Ordered keys (``ordered=``): one call of a key at a time, in publish order, on any
worker. Celery-free.

How the order is kept, step by step:

1. **At publish** each call takes the next *position* of its key from the store
   (ordered_stamp.lua: one more than the last one given), carried in the message's
   ``baton_ordered`` header as ``"<epoch>:<position>"``. "Publish order" is the order in
   which the store gave the positions: with several publishers, the order their publishes
   reached the store. A retry keeps its run's position.
2. **At the worker** the gate's ``"Q"`` condition (gate/ordered.lua) passes a call only
   when its position is the key's *next* one (``q``), and the exclusive lease of the key
   (the condition after it) makes it the only run of the key. Any other position waits
   in the consumer (no pool slot), woken by the release notice of the key's lease.
3. **At the end**, when the run's end is final (success, failure without retry, a
   Reject without requeue), its release moves ``q`` to the next position and wakes the
   waiters (release.lua, in the same script as the lease's release). A retry, or a
   message that comes back (``acks_late`` and a killed worker: its lease runs out and its
   copy runs again), keeps the position: the next call waits until it is final.
4. **A call that never comes** (expired or revoked before a worker took it, lost by the
   broker, a publisher that died between taking a position and sending) must not stop
   its key for ever: once ``q``'s call has not run for ``gap`` seconds (no lease on the
   key since ``q`` became next, or since the last one ran out, or since its retry was
   due), the next call that asks skips the missing positions, logged with the key and
   the positions, counted in the record (``celery baton locks``). Such a call that comes
   after all is **refused**, never run out of order: its result is a ``TaskSkipped``
   failure saying so, logged.
5. **A record that was lost** (the store restarted without its data, or it expired
   after ``RECORD_LIFE`` without a publish): a message stamped under the old epoch runs
   in arrival order, one at a time, logged; new publishes start a new line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from celery_baton.core.keys import KeyNames
from celery_baton.store.connection import STORE_ERRORS, Store

#: Seconds an order record lives past its last publish or advance (gate/ordered.lua):
#: a message queued longer than that finds it gone, and runs in arrival order.
RECORD_LIFE = 7 * 86400.0

_STAMP = re.compile(r"^(\d+):(\d+)$")


@dataclass(frozen=True)
class Place:
    """A call's place in its key's line: the record's ``epoch`` and its ``position``."""

    epoch: str
    position: int

    def header(self) -> str:
        return f"{self.epoch}:{self.position}"

    @classmethod
    def parse(cls, value: object) -> Place | None:
        """A ``baton_ordered`` header's place (None: absent or unreadable)."""
        if not isinstance(value, str):
            return None
        match = _STAMP.match(value)
        if match is None:
            return None
        return cls(match.group(1), int(match.group(2)))


@dataclass(frozen=True)
class Turn:
    """Why the gate's ``"Q"`` refused a call (its ``holder``): ``"wait"`` (a later
    position: it waits for ``next``), ``"gap"`` (an earlier position the gap bound
    skipped), ``"ran"`` (an earlier position whose call ran: a copy)."""

    what: str
    next: int

    @classmethod
    def parse(cls, holder: str) -> Turn:
        what, _, position = holder.partition(" ")
        return cls(what, int(position) if position.isdigit() else 0)


@dataclass(frozen=True)
class Note:
    """What the gate's ``"Q"`` did besides passing a call (``Decision.note``)."""

    assigned: Place | None = None  # an unstamped message was given this place
    skipped: tuple[int, int] | None = None  # positions skipped by the gap bound (inclusive)
    lost: bool = False  # the call's record is gone: it runs in arrival order

    @classmethod
    def parse(cls, note: str) -> Note:
        what, _, rest = note.partition(" ")
        if what == "assigned":
            return cls(assigned=Place.parse(rest))
        if what == "skip":
            first, _, last = rest.partition("-")
            if first.isdigit() and last.isdigit():
                return cls(skipped=(int(first), int(last)))
        if what == "lost":
            return cls(lost=True)
        return cls()


def positions(skipped: tuple[int, int]) -> str:
    """Skipped positions in words: ``"7"`` or ``"7-9"``."""
    first, last = skipped
    return str(first) if first == last else f"{first}-{last}"


class OrderedStamps:
    """The publish side: a call's place in its key's line, from the store.

    >>> OrderedStamps(store, names).take("bank.apply_event", "1f3a...")  # doctest: +SKIP
    Place(epoch='1732240000123456', position=7)
    """

    def __init__(self, store: Store, names: KeyNames) -> None:
        self.store = store
        self.names = names

    def take(self, task: str, key_digest: str, label: str = "") -> Place:
        """The next place of ``task``'s ordered key ``key_digest``; raises
        StoreUnavailable (the call is then not sent: sent without a place, it could run
        out of order). ``label``: the key in words, kept for the operator."""
        keys = [self.names.ordered(task, key_digest)]
        args = [round(RECORD_LIFE * 1000), label]
        try:
            epoch, position = self.store.scripts.call("ordered_stamp", keys, args)
        except STORE_ERRORS:
            # Once more, on a new connection: a pooled one the server closed (it restarted,
            # failed over) fails once. Had the first call run after all, its position is
            # a hole that the gap bound passes over.
            try:
                epoch, position = self.store.scripts.call("ordered_stamp", keys, args)
            except STORE_ERRORS as exc:
                raise self.store.unavailable(exc) from exc
        return Place(_text(epoch), int(position))


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
