"""Supersede: a newer publish replaces an older one of the same key. Celery-free.

Two store operations, for the two places where "newer" is decided:

* **Publish order** (``exclusive_conflict="replace"`` / ``"keep_last"``): each publish
  is stamped with an order taken from the store (supersede_stamp.lua: strictly
  increasing per key, on the store's clock), carried in the message, and compared at
  the worker's gate (gate.lua, ``"S"``): a delivery older than one that reached the gate
  is superseded, never run. So "newest" means the newest *publish*, whatever order the
  messages reach the workers in. A message without a stamp (sent by an app without
  ``Baton``) is given one when it first reaches the gate.
* **Unique replace** (``unique_conflict="replace"``): the new message is sent first, then
  the unique key is taken from its holder (unique_replace.lua). A holder still queued
  is marked superseded (the gate's ``"N"`` refuses it); one already started goes on.
  A publisher that dies between the two steps leaves both messages to run: the newest
  publish is never lost.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from celery_baton.core.keys import KeyNames
from celery_baton.store.connection import STORE_ERRORS, Store

logger = logging.getLogger("celery_baton.core.supersede")

#: How many times a replace follows a key that moved to yet another holder meanwhile.
MAX_MOVES = 10

CLAIMED, SUPERSEDED, RUNNING, MOVED = "claimed", "superseded", "running", "moved"


class Replaced(NamedTuple):
    """What a unique replace did: ``status`` is ``"claimed"`` (nobody held the key),
    ``"superseded"`` (``holder`` was queued and will never run) or ``"running"``
    (``holder`` started already and goes on)."""

    status: str
    holder: str


class Supersede:
    """The store side of superseding publishes, on one store.

    >>> Supersede(store, names).stamp("feeds.import", "1f3a...")  # doctest: +SKIP
    1732240000123456
    """

    def __init__(self, store: Store, names: KeyNames) -> None:
        self.store = store
        self.names = names

    def stamp(self, task: str, key_digest: str) -> int:
        """A new publish order for the exclusive key ``key_digest`` of ``task``; raises
        StoreUnavailable."""
        try:
            reply = self.store.scripts.call(
                "supersede_stamp", [self.names.supersede(task, key_digest)], []
            )
        except STORE_ERRORS as exc:
            raise self.store.unavailable(exc) from exc
        return int(reply)

    def replace(self, task: str, unique_key: str, task_id: str, ttl: float) -> Replaced:
        """Make ``task_id`` (whose message was sent) hold ``unique_key``, superseding the
        queued task that holds it; raises StoreUnavailable."""
        ttl_ms = max(1, round(ttl * 1000))
        mine = self.names.superseded(task, task_id)
        believed = ""
        for _ in range(MAX_MOVES):
            theirs = self.names.superseded(task, believed) if believed else mine
            try:
                status, holder = self.store.scripts.call(
                    "unique_replace", [unique_key, mine, theirs], [task_id, believed, ttl_ms]
                )
            except STORE_ERRORS as exc:
                raise self.store.unavailable(exc) from exc
            status, holder = _text(status), _text(holder)
            if status != MOVED:
                return Replaced(status, holder)
            believed = holder
        # Replaced by others faster than we could follow: our message is sent and runs.
        logger.warning("unique key %s kept moving; %s runs without holding it", unique_key, task_id)
        return Replaced(RUNNING, believed)


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value or "")
