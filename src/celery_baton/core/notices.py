"""Release notices and worker reports: the store's two side channels. Celery-free.

A release of a key that someone waits for is published on the notice channel (see
release.lua); :class:`NoticeListener` relays each released key to a callback, so held
requests wake at once instead of at their timer. Each worker also writes a report of
its own state (held requests, counters) that ``celery baton status`` and the web view
read; :class:`WorkerReports` writes and removes it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from celery_baton.core.keys import KeyNames
from celery_baton.store.connection import STORE_ERRORS, Store

logger = logging.getLogger("celery_baton.core.notices")


#: Seconds the listener waits for a notice before it says again that it heard them all.
POLL = 0.25
#: Seconds a poll may end late and still say that nothing came (a loaded machine).
LATE_POLL = 0.1


class NoticeListener(threading.Thread):
    """Calls ``on_release(key)`` for every released key, reconnecting with back-off.

    ``on_heard(at)``, when given, is told (``time.monotonic()``) each time every notice
    sent before ``at`` was handled: when the connection had nothing more to read. After
    a (re)subscription, not before ``on_connected()`` (what was sent while it was not
    subscribed, read from the store instead) returned True: a notice sent while the
    connection was down never comes."""

    def __init__(
        self,
        store: Store,
        channel: str,
        on_release: Callable[[str], None],
        *,
        on_heard: Callable[[float], None] | None = None,
        on_connected: Callable[[], bool] | None = None,
    ) -> None:
        super().__init__(name="baton-notices", daemon=True)
        self.store = store
        self.channel = channel
        self.on_release = on_release
        self.on_heard = on_heard
        self.on_connected = on_connected
        self._stop_event = threading.Event()

    def run(self) -> None:
        delay = 0.5
        while not self._stop_event.is_set():
            pubsub = None
            try:
                pubsub = self.store.client.pubsub()
                pubsub.subscribe(self.channel)
                delay = 0.5
                subscribed = synced = False
                while not self._stop_event.is_set():
                    began = time.monotonic()
                    message = pubsub.get_message(timeout=POLL)
                    kind = message.get("type") if message else None
                    if kind == "message":
                        self.on_release(str(message["data"]))
                        continue
                    subscribed = subscribed or kind == "subscribe"
                    if subscribed and not synced:
                        # Every notice from here on comes on the subscription; those
                        # sent before it are read from the store.
                        synced = self.on_connected is None or self.on_connected()
                    elif time.monotonic() - began > POLL + LATE_POLL:
                        # The process stood still in the poll: its timer may have ended
                        # it before the socket was read (a greenlet), so it proves
                        # nothing; the next poll does.
                        continue
                    if synced and self.on_heard is not None:
                        self.on_heard(began)  # nothing came since the poll began
            except STORE_ERRORS as exc:
                logger.debug("notice listener lost the store (%r); reconnecting", exc)
                # Held requests still wake on their timers meanwhile.
                self._stop_event.wait(delay)
                delay = min(delay * 2, 10.0)
            except Exception:
                logger.exception("notice listener crashed; restarting")
                self._stop_event.wait(1.0)
            finally:
                if pubsub is not None:
                    try:
                        pubsub.close()
                    except Exception:  # closing a dead connection may fail; nothing to do
                        logger.debug("closing pubsub failed", exc_info=True)

    def stop(self) -> None:
        self._stop_event.set()


#: How often a live worker shows it lives (the lease book's thread; one PEXPIRE), and
#: how long its report outlives the last sign. A dead holder is seen as dead (its leases
#: STALE, itself gone from ``status``) within REPORT_TTL of its death whatever its
#: ``lease_ttl``; a live worker's renewer stalled that long (a store slower than that, a
#: long pause) is shown stale meanwhile, which only the operator's view reads.
HEARTBEAT = 1.0
REPORT_TTL = 5.0


class WorkerReports:
    """A worker's report in the store: ``<prefix>:worker:<hostname>``, JSON, with a short
    ttl kept up by :meth:`touch` every :data:`HEARTBEAT`, so that a worker that died
    leaves the listing by itself within :data:`REPORT_TTL` (and its leases show STALE),
    while the report itself is written again only every renewal interval."""

    def __init__(self, store: Store, names: KeyNames) -> None:
        self.store = store
        self.names = names

    def write(self, hostname: str, report: dict[str, Any], ttl: float) -> None:
        try:
            self.store.client.set(
                self.names.worker(hostname), json.dumps(report), px=max(1, round(ttl * 1000))
            )
        except STORE_ERRORS as exc:
            raise self.store.unavailable(exc) from exc

    def touch(self, hostname: str, ttl: float = REPORT_TTL) -> bool:
        """Extend the report's life; False when it is gone (expired while the store or
        this worker stalled, or the store lost it): write it again then."""
        try:
            return bool(
                self.store.client.pexpire(self.names.worker(hostname), max(1, round(ttl * 1000)))
            )
        except STORE_ERRORS as exc:
            raise self.store.unavailable(exc) from exc

    def remove(self, hostname: str) -> None:
        """A clean stop leaves the listing at once (best effort: the ttl is the fallback)."""
        with contextlib.suppress(*STORE_ERRORS):
            self.store.client.delete(self.names.worker(hostname))
