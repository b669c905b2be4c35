"""Unique claims at publish time, and their give-back. Celery-free.

A publish of a ``unique`` task first claims its key with the task id as owner
(unique_claim.lua: set if absent, else answer the holder). A publish that then does
not happen gives its claim back (unique_release.lua: delete if still ours). When the
store does not answer, the claim may still be executed later (a paused store runs
what it buffered when it resumes), even after the give-back, which goes on another
connection. So a claim carries the moment its publisher stops waiting for the answer,
on the store's clock (learned once a minute with ``TIME``): run later, it writes
nothing. One that still ran (the clocks' estimate is off by a round trip) is undone by
the give-back (unique_give_back.lua), which leaves a mark that makes a later claim
write nothing too, and is retried in the background, by one thread per process (not
one per failure), until the store answers.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable

from celery_baton.core.keys import given_back
from celery_baton.errors import BatonError, StoreUnavailable
from celery_baton.store.connection import STORE_ERRORS, Store
from celery_baton.store.inspect import label_key, server_now_ms
from celery_baton.store.scripts import Pending

#: Seconds at least that a give-back's mark waits for the late claim it undoes: the
#: claim runs as soon as the paused store resumes, but the give-back may come first.
GIVE_BACK_MARK_MIN = 60.0

#: Seconds at least that a give-back is retried while the store does not answer (a
#: store paused longer still runs the claim it buffered: its key then lapses with the
#: claim's ttl, and the loss is logged).
GIVE_BACK_RETRY_FOR = 3600.0

#: Seconds between two readings of the store's clock (``TIME``).
CLOCK_EVERY = 60.0

logger = logging.getLogger("celery_baton.core.unique")


class UniqueClaims:
    """Claim, read, and give back unique keys on one store."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._retries = Retries()
        self._offset_ms: float | None = None  # the store's clock minus ours
        self._offset_read = -CLOCK_EVERY  # monotonic time of the last reading

    def _deadline_ms(self) -> int:
        """When a claim sent now is answered too late for its publisher, on the store's
        clock: a quarter of the socket timeout (at most 0.25 s) before the publisher gives
        up, for the error of the clock reading. 0 (none) while the clock is unknown."""
        if time.monotonic() - self._offset_read >= CLOCK_EVERY:
            self._read_clock()
        if self._offset_ms is None or not self.store.socket_timeout:
            return 0
        waits = self.store.socket_timeout - min(0.25, self.store.socket_timeout / 4)
        return int(time.time() * 1000 + self._offset_ms + waits * 1000)

    def _read_clock(self) -> None:
        self._offset_read = time.monotonic()
        try:
            server_ms = server_now_ms(self.store)
        except STORE_ERRORS:
            return  # the claim will tell; keep the last reading
        # Read as our clock after the reply: the store's time looks a round trip late at
        # most, so deadlines come early, never late.
        self._offset_ms = server_ms - time.time() * 1000

    def send(self, key: str, task_id: str, ttl: float, *, label: str = "") -> Pending:
        """Write the claim now; :meth:`result` reads its answer (the round trip overlaps
        what the caller does meanwhile: building the message). ``label``: the key in
        words, kept beside the claim for the operator."""
        # A give-back of this key still pending (an earlier publish whose claim went
        # unanswered) goes first: else this publish could be deduplicated into a claim
        # whose message was never sent (seen in the nemesis soak).
        self._retries.run_now(key)
        try:
            keys = [key, given_back(key, task_id)] + ([label_key(key)] if label else [])
            return self.store.scripts.send(
                "unique_claim",
                keys,
                [task_id, round(ttl * 1000), self._deadline_ms(), *([label] if label else [])],
            )
        except STORE_ERRORS as exc:
            self.release_later(key, task_id, ttl)  # part of it may have been written
            raise self.store.unavailable(exc) from exc

    def result(self, pending: Pending, key: str, task_id: str, ttl: float) -> str:
        """'' when ``task_id`` holds the key now, else the holder's task id."""
        try:
            holder = self.store.scripts.result(pending)
        except STORE_ERRORS as exc:
            # The claim may still run later: give it back once the store answers, or
            # it would block the key for ttl.
            self.release_later(key, task_id, ttl)
            raise self.store.unavailable(exc) from exc
        if holder == -1:  # answered, but too late for the claim to count: nothing written
            raise StoreUnavailable(
                "store call failed: the unique claim reached the store after its publisher's "
                "socket timeout (nothing was claimed)",
                url=self.store.safe_url,
            )
        return str(holder or "")

    def release(self, key: str, task_id: str) -> bool:
        """Free ``key`` if ``task_id`` holds it; raises StoreUnavailable."""
        try:
            return bool(self.store.scripts.run("unique_release", [key], [task_id]))
        except STORE_ERRORS as exc:
            raise self.store.unavailable(exc) from exc

    def give_back(self, key: str, task_id: str, ttl: float) -> bool:
        """Undo ``task_id``'s claim of ``key``, written or not yet: a claim the store runs
        later writes nothing (``unique_give_back.lua``); raises StoreUnavailable."""
        mark_ms = round(max(ttl, GIVE_BACK_MARK_MIN) * 1000)
        try:
            keys = [key, given_back(key, task_id)]
            return bool(self.store.scripts.run("unique_give_back", keys, [task_id, mark_ms]))
        except STORE_ERRORS as exc:
            raise self.store.unavailable(exc) from exc

    def release_later(self, key: str, task_id: str, ttl: float) -> None:
        """Give ``key`` back in the background until it works, and once more after that.

        Not only for ``ttl``: a store that answers nothing (paused) may still run the
        claim when it resumes, and the claim's ttl starts then; the give-back must land
        once the store answers, however long that took (its mark undoes a claim that
        runs after it). Retried for ``GIVE_BACK_RETRY_FOR`` at least."""
        deadline = time.monotonic() + max(ttl, GIVE_BACK_RETRY_FOR)
        state = {"done": 0}

        def attempt() -> bool:
            self.give_back(key, task_id, ttl)
            state["done"] += 1
            return state["done"] >= 2  # finished after the second success

        self._retries.add(attempt, deadline, key=key)


class Retries:
    """One background thread that retries give-backs with back-off until each says it
    is done or its deadline passes."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, float, float, Callable[[], bool]]] = []
        self._order = itertools.count()
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._by_key: dict[str, list[Callable[[], bool]]] = {}

    def run_now(self, key: str) -> None:
        """Try ``key``'s pending give-backs at once, on the caller's thread (their
        scheduled retries stay: a give-back is idempotent)."""
        if not self._by_key:  # none pending (every publish asks): no lock taken
            return
        with self._lock:
            attempts = list(self._by_key.get(key, ()))
        for attempt in attempts:
            with contextlib.suppress(BatonError):
                attempt()

    def add(self, attempt: Callable[[], bool], deadline: float, *, key: str = "") -> None:
        with self._lock:
            if key:
                self._by_key.setdefault(key, []).append(attempt)
            heapq.heappush(
                self._heap, (time.monotonic() + 0.5, next(self._order), 0.5, deadline, attempt)
            )
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="baton-giveback", daemon=True
                )
                self._thread.start()
            self._lock.notify()

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._heap or self._heap[0][0] > time.monotonic():
                    timeout = self._heap[0][0] - time.monotonic() if self._heap else None
                    self._lock.wait(timeout)
                _, _, delay, deadline, attempt = heapq.heappop(self._heap)
            try:
                finished = attempt()
                delay = 0.5
            except BatonError:
                finished = False
                delay = min(delay * 2, 2.0)  # the store is back soon: ask often
            except Exception:  # the retrier must outlive any surprise
                logger.exception("a unique give-back crashed; retrying")
                finished, delay = False, 10.0
            if not finished and time.monotonic() < deadline:
                with self._lock:
                    heapq.heappush(
                        self._heap,
                        (time.monotonic() + delay, next(self._order), delay, deadline, attempt),
                    )
            else:
                if not finished:
                    logger.warning(
                        "a unique give-back still failed when its retries ran out; a claim"
                        " the store runs later keeps its key until its ttl"
                    )
                self._forget(attempt)

    def _forget(self, attempt: Callable[[], bool]) -> None:
        with self._lock:
            for key, attempts in list(self._by_key.items()):
                if attempt in attempts:
                    attempts.remove(attempt)
                    if not attempts:
                        del self._by_key[key]
