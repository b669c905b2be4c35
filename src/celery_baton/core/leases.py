"""Leases: a lock held by an owner for a ttl, renewed while the owner lives. Celery-free.

The race every hand-written Celery lock loses: worker A's lock expires while A is paused
(GC, swap, a slow query); B takes it; A wakes and deletes "the lock" with a plain DEL,
freeing B's lock; C takes it and now B and C run together. Here:

1. release compares the owner in the script: A's release frees nothing of B's;
2. each acquisition gets a fencing token that grows per key, so A's late writes can be
   refused downstream (``UPDATE ... WHERE fence < :fence``);
3. live owners renew every ttl/3 in one batched call, so a long run keeps its lease,
   and a killed owner's lease ends when its ttl runs out;
4. a renewal never brings back a lease that was released, unlocked or expired, even
   when it reaches the store after the release (another connection, a re-sent call),
   unless the store lost its data (the family's epoch tells: renew.lua).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import queue
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType

from celery_baton import metrics
from celery_baton.core.conditions import TakeLease
from celery_baton.core.gate import ENDED, LOST, REASSERTED, Gate, HeldClaim, HeldLease, Release
from celery_baton.core.keys import words
from celery_baton.errors import BatonError, LeaseNotOwned
from celery_baton.store.connection import STORE_ERRORS
from celery_baton.store.inspect import label_key
from celery_baton.store.schema import make_owner

logger = logging.getLogger("celery_baton.core.leases")


class _Nonces:
    """Per-process nonces: a random prefix and a counter. Asking the OS for random bytes
    (or even for the pid) per delivery costs a system call on the worker's hot path; a
    forked child draws a new prefix, which keeps processes and restarts apart."""

    def __init__(self) -> None:
        self.reset()
        os.register_at_fork(after_in_child=self.reset)

    def reset(self) -> None:
        self.prefix = secrets.token_hex(4)
        self.counter = itertools.count()

    def next(self) -> str:
        return f"{self.prefix}{next(self.counter):x}"


_nonces = _Nonces()


def new_owner(task_id: str, worker: str) -> str:
    """An owner token unique to one delivery (store/schema.py)."""
    return make_owner(task_id, worker, _nonces.next())


class Lease:
    """A lease on one key, for use outside Celery tasks too.

    >>> with Lease(gate, "baton:{jobs}:ex:nightly", ttl=10) as lease:  # doctest: +SKIP
    ...     write(fence=lease.fence)
    """

    def __init__(
        self, gate: Gate, key: str, *, ttl: float = 10.0, limit: int = 1, owner: str | None = None
    ) -> None:
        self.gate = gate
        self.key = key
        self.ttl = ttl
        self.limit = limit
        self.owner = owner or new_owner("-", "lease")
        self.fence = 0
        self.holder = ""
        self.epoch = ""  # the store epoch it was granted (or re-asserted) under

    def acquire(self) -> bool:
        """Take the lease now if it is free; ``self.fence`` is its token. One round trip."""
        decision = self.gate.decide(
            [TakeLease(self.key, limit=self.limit, fence=True)],
            owner=self.owner,
            ttl=self.ttl,
        )
        self.fence = decision.fence if decision.granted else 0
        self.holder = decision.holder
        self.epoch = decision.epoch
        return decision.granted

    def renew(self) -> bool:
        """Extend the lease by its ttl; False when it is lost (released, unlocked, expired
        or taken). One round trip."""
        held = HeldLease(self.key, self.owner, self.limit, self.ttl, self.epoch)
        renewal = self.gate.renew([held])[0]
        if renewal.status == REASSERTED:
            self.epoch = renewal.epoch
        return renewal.status != LOST

    def release(self) -> bool:
        """Free the lease if this owner holds it; never anyone else's. One round trip."""
        return self.gate.release([self.key], owner=self.owner) == 1

    def __enter__(self) -> Lease:
        if not self.acquire():
            raise LeaseNotOwned(f"held by {self.holder}", key=self.key)
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


#: While the store stays down, the renewer says so again this often (seconds).
DOWN_REPEAT = 60.0


class LeaseBook:
    """The leases one process holds, renewed together in one call every ``interval``.

    ``on_lost(owner, key)`` is called (from the renewer thread) when a lease was taken
    over by someone else: its run no longer has exclusivity, which must be loud.
    Releases that failed because the store was down are retried here too.
    """

    def __init__(
        self,
        gate: Gate,
        *,
        interval: float,
        on_lost: Callable[[str, str], None] | None = None,
        on_tick: Callable[[], None] | None = None,
        heartbeat: float | None = None,
        on_heartbeat: Callable[[], None] | None = None,
        ending: Callable[[str], bool] | None = None,
    ) -> None:
        self.gate = gate
        self.interval = interval
        #: Whether an owner's run is over by its own process's word (core/shared_ends):
        #: a lease that process freed is its release, not a loss, before this process
        #: hears of the end.
        self.ending = ending or (lambda owner: False)
        self.on_lost = on_lost
        self.on_tick = on_tick  # e.g. the worker's status report, on the same schedule
        # A sign of life more often than renewals (a long lease_ttl renews seldom): the
        # operator sees a dead holder within seconds, not within its lease_ttl.
        self.heartbeat = heartbeat if on_heartbeat is not None else None
        self.on_heartbeat = on_heartbeat
        self._held: dict[str, list[HeldLease]] = {}
        self._claims: dict[str, HeldClaim] = {}  # owner -> its run's unique claim
        # owner -> {lease key: the text its digest was made of}: written to the store
        # as the key in words (keys.words) by this thread, off the consumer's loop.
        self._labels: dict[str, Mapping[str, str]] = {}
        self._unlabelled: list[str] = []  # owners whose labels are not written yet
        # Releases that failed (the store down), retried by the renewer: each with the
        # keys it frees (said if the worker stops before they were sent).
        self._pending_releases: list[tuple[Callable[[], object], tuple[str, ...]]] = []
        # What the store said was lost (leases) or gone (unique claims), by owner: reported
        # at the next pass if the owner's run still goes on then (not removed meanwhile).
        self._lost: dict[str, list[HeldLease]] = {}
        self._gone_claims: dict[str, HeldClaim] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.renewals = 0
        self.losses = 0
        self._down_since: float | None = None  # monotonic time the store went down
        self._down_said = 0.0

    def add(
        self,
        owner: str,
        leases: list[HeldLease],
        *,
        epoch: str = "",
        claim: HeldClaim | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> None:
        """Hold ``owner``'s ``leases`` (and its run's unique ``claim``) from now on;
        ``epoch``: the grant's (Decision.epoch); ``labels``: the plan's (RunPlan.labels),
        the keys in words for the operator, written on this book's next pass."""
        if claim is not None:
            with self._lock:
                self._claims[owner] = claim
        if leases:
            if epoch:
                leases = [HeldLease(x.key, x.owner, x.limit, x.ttl, epoch) for x in leases]
            with self._lock:
                self._held[owner] = leases
                if labels:
                    self._labels[owner] = labels
                    self._unlabelled.append(owner)

    def remove(self, owner: str) -> list[HeldLease]:
        with self._lock:
            self._lost.pop(owner, None)
            self._gone_claims.pop(owner, None)
            self._claims.pop(owner, None)
            self._labels.pop(owner, None)
            return self._held.pop(owner, [])

    def write_labels(self, *, every: bool = False) -> None:
        """Write the keys in words of the leases granted since the last pass (``every``:
        of all held leases, which keeps them as long as the leases and writes back what
        a store lost). One pipelined SET per lease, with the lease's ttl; never on the
        gate's path."""
        with self._lock:
            owners = list(self._labels) if every else self._unlabelled
            self._unlabelled = []
            items = [
                (lease.key, self._labels[owner][lease.key], lease.ttl)
                for owner in owners
                if owner in self._labels
                for lease in self._held.get(owner, ())
                if lease.key in self._labels[owner]
            ]
        if not items:
            return
        store = self.gate.store
        try:
            pipe = store.client.pipeline(transaction=False)
            for key, material, ttl in items:
                pipe.set(label_key(key), words(key, material), px=max(1, round(ttl * 1000)))
            pipe.execute()
        except STORE_ERRORS as exc:
            raise store.unavailable(exc) from exc

    def held(self) -> list[HeldLease]:
        with self._lock:
            held = [lease for leases in self._held.values() for lease in leases]
        metrics.leases_now.set(len(held))
        return held

    def retry_later(self, release: Callable[[], object], keys: Sequence[str] = ()) -> None:
        """Queue a release that failed (store down) to be retried by the renewer;
        ``keys``: the lease keys it frees."""
        with self._lock:
            self._pending_releases.append((release, tuple(keys)))

    def _report_losses(self) -> None:
        """Report what an earlier pass found lost (a lease) or gone (a unique claim) of a
        run that still goes on.

        Reported one pass after the store said so, if its owner was not removed since: a
        run whose end this process had not heard of yet (its pool process freed the claim
        at the body's end, or still sent its release to a store that stalled past the
        lease's deadline, while this process's consumer reconnected) was over, not
        running without them."""
        with self._lock:
            lost, self._lost = self._lost, {}
            gone, self._gone_claims = self._gone_claims, {}
        for owner, leases in lost.items():
            if self.ending(owner):
                continue  # its run was over after all: the lease went with its end
            for lease in leases:
                self.losses += 1
                metrics.lease_losses.inc()
                logger.error(
                    "lease lost: %s held by %s expired, was unlocked or taken over",
                    lease.key,
                    lease.owner,
                )
                if self.on_lost:
                    self.on_lost(lease.owner, lease.key)
        for claim in gone.values():
            logger.warning(
                "unique claim %s of running task %s is gone (freed by hand, or the store "
                "lost it): a duplicate publish may be queued beside it",
                claim.key,
                claim.task_id,
            )

    def unsent_keys(self) -> list[str]:
        """The lease keys of the releases still waiting to be sent."""
        with self._lock:
            return [key for _, keys in self._pending_releases for key in keys]

    def renew_now(self) -> None:
        self._report_losses()
        held = self.held()
        if held:
            renewals = self.gate.renew(held)
            self.renewals += len(held)
            metrics.lease_renewals.inc(len(held))
            for lease, renewal in zip(held, renewals, strict=True):
                if renewal.status not in (LOST, REASSERTED, ENDED):
                    continue
                with self._lock:
                    # A run that finished while the call was on its way released its
                    # lease: "lost" is then its own release, nothing to report. If the
                    # store had forgotten it, the renewal wrote it back for a run that
                    # is over: give it back (owner-compared, so never anyone else's).
                    current = self._held.get(lease.owner)
                    if current is not None and self.ending(lease.owner):
                        # Over: its run's process freed it at the body's end, and this
                        # process has not heard of the end yet. Not renewed again.
                        self._held[lease.owner] = [x for x in current if x.key != lease.key]
                        current = None
                    if current is None:
                        if renewal.status == REASSERTED:
                            self._pending_releases.append(
                                (
                                    functools.partial(
                                        self.gate.release, [lease.key], owner=lease.owner
                                    ),
                                    (lease.key,),
                                )
                            )
                        continue
                    if renewal.status != REASSERTED:
                        # Not renewed again. Ended: its run's process freed it as the
                        # body ended, and this process has not heard of the end yet (its
                        # consumer may be reconnecting): nothing to report. Lost is lost
                        # for good (unlocked, expired, taken over): one incident, one
                        # report, at the next pass if its run goes on then. Its other
                        # leases are kept.
                        self._held[lease.owner] = [x for x in current if x.key != lease.key]
                        if renewal.status == LOST:
                            self._lost.setdefault(lease.owner, []).append(lease)
                        continue
                    # Renew under the store's new epoch from now on.
                    self._held[lease.owner] = [
                        HeldLease(x.key, x.owner, x.limit, x.ttl, renewal.epoch)
                        if x.key == lease.key
                        else x
                        for x in current
                    ]
                logger.warning("lease re-asserted after the store lost it: %s", lease.key)
        self._keep_claims()
        with self._lock:
            pending, self._pending_releases = self._pending_releases, []
        for i, (release, _keys) in enumerate(pending):
            try:
                release()
            except BatonError:
                with self._lock:
                    self._pending_releases.extend(pending[i:])
                raise

    def _keep_claims(self) -> None:
        with self._lock:
            claims = list(self._claims.items())
        if not claims:
            return
        kept = self.gate.keep_claims([claim for _, claim in claims], time.time())
        for (owner, claim), ok in zip(claims, kept, strict=True):
            if ok:
                continue
            with self._lock:
                if self._claims.get(owner) is not claim:
                    continue  # the run finished meanwhile and freed its claim itself
                del self._claims[owner]
                self._gone_claims[owner] = claim  # said at the next pass, if it runs on

    def _run(self) -> None:
        due = time.monotonic() + self.interval
        while True:
            wait = due - time.monotonic()
            if self.heartbeat is not None:
                wait = min(wait, self.heartbeat)
            if self._stop.wait(max(0.0, wait)):
                return
            try:
                if time.monotonic() < due:
                    # The store down: the next renewal says so (_store_down).
                    with contextlib.suppress(BatonError):
                        self.write_labels()
                        if self.on_heartbeat is not None:
                            self.on_heartbeat()
                    continue
                due = time.monotonic() + self.interval
                self.renew_now()
                self.write_labels(every=True)
                if self.on_tick is not None:
                    self.on_tick()
            except BatonError as exc:
                self._store_down(exc)
            except Exception:  # the renewer must outlive any surprise
                logger.exception("lease renewal crashed; retrying")
            else:
                if self._down_since is not None:  # a whole renewal pass went through
                    logger.warning(
                        "the store answers again (down for %.0fs)",
                        time.monotonic() - self._down_since,
                    )
                    self._down_since = None

    def _store_down(self, exc: BaseException) -> None:
        """The store down: said when it goes down, then once a minute while it stays
        down (not at every renewal: every 2.7 s by default), and when it answers again."""
        now = time.monotonic()
        if self._down_since is None:
            self._down_since = self._down_said = now
            # Said of the leases only when some are held: the pass also writes labels and
            # the batching ticks, and "lease renewal failed" on an idle worker misled.
            leases = "lease renewal failed, " if self.held() else ""
            logger.warning(
                "%sthe store is down: %s. Retrying every %.1fs; said again every %.0fs "
                "while it stays down",
                leases,
                exc,
                self.interval,
                DOWN_REPEAT,
            )
        elif now - self._down_said >= DOWN_REPEAT:
            self._down_said = now
            logger.warning("the store is still down (for %.0fs): %s", now - self._down_since, exc)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="baton-renewer", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


class Releaser:
    """Sends releases from a background thread, all that are waiting in one round trip.

    A worker's event loop must not wait for the store after every task: releases are
    handed over here and sent within a millisecond, batched under load. Releases that
    fail (the store is down) go to ``on_failure`` to be retried; none is dropped.
    """

    BATCH = 256

    def __init__(self, gate: Gate, *, on_failure: Callable[[Release], None]) -> None:
        self.gate = gate
        self.on_failure = on_failure
        self._queue: queue.SimpleQueue[Release | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, release: Release) -> None:
        self._queue.put(release)

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            stop = False
            while len(batch) < self.BATCH:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stop = True
                    break
                batch.append(item)
            self._send(batch)
            if stop:
                return

    def _send(self, batch: list[Release]) -> None:
        try:
            self.gate.release_many(batch)
        except BatonError as exc:
            logger.warning("%d releases failed, retrying in the background: %s", len(batch), exc)
            for release in batch:
                self.on_failure(release)
        except Exception:  # the releaser must outlive any surprise, and lose nothing
            logger.exception("releases crashed; retrying them in the background")
            for release in batch:
                self.on_failure(release)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="baton-releaser", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Send what is queued, then stop."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=10)
            self._thread = None
