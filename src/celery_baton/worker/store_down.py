"""Admission's store-down policy: what a delivery does when the store did not answer.

``baton_on_store_error="hold"`` holds it in the store's own wait queue and asks again
with a back-off that doubles up to ``BACKOFF_MAX`` (nothing runs unguarded); ``"run"``
runs it unguarded, logged. For one back-off after a failure, new deliveries do not wait
on the store again: they queue behind the delivery that is probing it. Whatever an
unanswered ask may have granted is given back.

The back-off is only a bound: while requests are held for the store, a PING every
``PROBE_INTERVAL`` asks whether it answers again, and as soon as it answers anything (a
probe, or an ask of another delivery) they are asked again. After a failover the new
master is used within a second of answering, not after the back-off (up to 10 s, and
the channel's own before it: a minute in the issue 24 measurement).

Also here: the warning that the store is new or lost its data (the grace of
``verdict.Reason.GRACE``), at most every 10 s, with the command that ends it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from celery_baton.core.gate import Gate
from celery_baton.errors import BatonError, StoreUnavailable
from celery_baton.worker.holding import BACKOFF_START, Delivery, Holding
from celery_baton.worker.releasing import Releasing
from celery_baton.worker.verdict import Reason, Wait

logger = logging.getLogger("celery_baton.worker")

STORE_KEY = "<store>"  # the wait queue of requests held because the store is down
BACKOFF_MAX = 10.0
PROBE_INTERVAL = 1.0  # seconds between PINGs while requests are held for the store


def warn_eviction(gate: Gate) -> None:
    """At worker start: a store whose ``maxmemory-policy`` may evict keys loses leases
    silently when it is full; say so (and say when it cannot be checked)."""
    try:
        warning = gate.eviction_warning()
    except BatonError as exc:  # down at start: the start's own report says so
        logger.info("baton: could not check the store's maxmemory-policy: %s", exc)
        return
    if warning.startswith("cannot check"):
        logger.info("baton: %s", warning)
    elif warning:
        logger.warning("baton: %s", warning)


class StoreDown:
    """The store-down policy; see the module docstring.

    ``new_owner(request)`` names a new owner for a delivery's next ask;
    ``run_unguarded(delivery)`` starts it without leases (``"run"``).
    """

    def __init__(
        self,
        *,
        on_store_error: str,
        holding: Holding,
        releasing: Releasing,
        new_owner: Callable[[Any], str],
        run_unguarded: Callable[[Delivery], None],
        on_back: Callable[[], None] = lambda: None,
    ) -> None:
        self.on_store_error = on_store_error
        self.holding = holding
        self.releasing = releasing
        self.new_owner = new_owner
        self.run_unguarded = run_unguarded
        self.on_back = on_back  # the store answers again after requests were held for it
        self._down_until = 0.0
        self._grace_logged = -1e9
        #: The outage's requests held in STORE_KEY's queue (ids; empty: none) and when
        #: the first was held: one WARNING for the first, INFO for the others, their
        #: number when the store answers again (a WARNING per request flooded the log:
        #: 56 lines for 50 tasks).
        self._held_ids: set[str] = set()
        self._held_since = 0.0
        self._probe_due = 0.0  # when the armed probe fires (0: none armed)

    def failed_moments_ago(self, now: float) -> bool:
        """Whether a new delivery should not wait on the store now (it just failed)."""
        return now < self._down_until

    def lost(self, delivery: Delivery) -> None:
        """An ask for ``delivery`` was sent and not answered."""
        # The store may still execute the lost ask: what it grants that owner is
        # released once the store answers again; a new attempt asks as a new owner, so
        # that release cannot free its grant.
        self.releasing.give_back_lost(delivery.plan)
        delivery.plan = delivery.plan.with_owner(self.new_owner(delivery.request))

    def answered(self, delivery: Delivery) -> None:
        """The store answered ``delivery``: it is up again."""
        delivery.backoff = BACKOFF_START
        self.store_answered()

    def store_answered(self) -> None:
        """The store answered a call: the requests held for it are asked again now."""
        self._down_until = 0.0
        if self._held_ids:
            self._say_back()
            with self.holding.lock:
                self.holding.spread(STORE_KEY)
            self.on_back()

    def recovered(self) -> None:
        """The store answers again after a call failed (``GateChannel.on_recovered``):
        every held request asks again now, not only those held for the store. One held
        for a key may wait for a release notice that was lost meanwhile (the release
        itself was re-sent to a new master, where nobody was marked waiting), and its
        timer may be a whole lease away."""
        self._down_until = 0.0
        held_for_store = bool(self._held_ids)
        if held_for_store:
            self._say_back()
        with self.holding.lock:
            self.holding.spread(STORE_KEY)
            self.holding.wake_all()
        if held_for_store:
            self.on_back()

    def _say_back(self) -> None:
        logger.warning(
            "baton: the store answers again after %.1fs: %d guarded request(s) held for it "
            "ask again",
            time.monotonic() - self._held_since,
            len(self._held_ids),
        )
        self._held_ids = set()

    def failed(self, delivery: Delivery, error: BaseException) -> None:
        """The ask for ``delivery`` failed with ``error``: hold it, or run it unguarded."""
        if not isinstance(error, StoreUnavailable):
            raise error
        request = delivery.request
        delay = delivery.backoff
        now = time.monotonic()
        if self._down_until <= now:
            self._down_until = now + delay
        if self.on_store_error == "run":
            logger.warning(
                "store unavailable, running %s[%s] UNGUARDED (baton_on_store_error='run'): %s",
                request.name,
                request.id,
                error,
            )
            self.run_unguarded(delivery)
            return
        delivery.backoff = min(BACKOFF_MAX, delivery.backoff * 2)
        first = not self._held_ids
        if first:
            self._held_since = now
        self._held_ids.add(request.id)
        logger.log(
            logging.WARNING if first else logging.INFO,
            "store unavailable, holding %s[%s], retry in %.2fs: %s%s",
            request.name,
            request.id,
            delay,
            error,
            " (guarded requests wait until it answers; the next ones are logged at INFO,"
            " their number when it answers)"
            if first
            else "",
        )
        self.holding.hold(delivery, Wait(Reason.STORE_DOWN, STORE_KEY, delay))
        self._arm_probe(now)

    def _arm_probe(self, now: float) -> None:
        # Pipelined channels only: without an event loop an ask is answered at once,
        # and the back-off alone paces them. A probe whose timer a consumer restart
        # dropped (overdue) is armed again.
        channel = self.releasing.channel
        if not channel.pipelined or (self._probe_due and now < self._probe_due + PROBE_INTERVAL):
            return
        self._probe_due = now + PROBE_INTERVAL
        self.holding.consumer.timer.call_after(PROBE_INTERVAL, self._probe, priority=5)

    def _probe(self) -> None:
        # kombu's timer swallows exceptions: a probe that fails is armed again.
        self._probe_due = 0.0
        if not self._held_ids:
            return
        try:
            self.releasing.channel.ping(self._probed)
        except Exception:
            logger.exception("baton: probing the store failed; trying again")
            self._arm_probe(time.monotonic())

    def _probed(self, reply: Any) -> None:
        try:
            if isinstance(reply, BaseException):
                if self._held_ids:
                    self._arm_probe(time.monotonic())
            else:
                self.store_answered()
        except Exception:
            logger.exception("baton: waking the requests held for the store failed")

    def warn_grace(self, delay: float, now: float) -> None:
        """The gate refused for the grace of a new (or emptied) store."""
        if now - self._grace_logged > 10:
            self._grace_logged = now
            # The store forgot: the ends recorded lately may be gone with it.
            recorded = self.releasing.recorded
            if recorded is not None:
                recorded.write_back("the store is new or lost its data (grace)")
            app = getattr(getattr(self.holding.consumer, "app", None), "main", None)
            logger.warning(
                "baton: the store is new or lost its data (it started less than a "
                "lease_ttl ago, or was emptied, or a replica was promoted): no new lease "
                "for %.1fs, while running tasks write theirs back (grace). If no worker "
                "can hold a lease from before it (a new store, or every worker was "
                "stopped), end it now: celery -A %s baton end-grace (--force while workers "
                "run)",
                delay,
                app or "proj",
            )
