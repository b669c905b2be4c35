"""Admission's store-down policy: what a delivery does when the store did not answer.

``baton_on_store_error="hold"`` holds it in the store's own wait queue and asks again
with a back-off that doubles up to ``BACKOFF_MAX`` (nothing runs unguarded); ``"run"``
runs it unguarded, logged. For one back-off after a failure, new deliveries do not wait
on the store again: they queue behind the delivery that is probing it. Whatever an
unanswered ask may have granted is given back.

Also here: the warning that the store is new or lost its data (the grace of
``verdict.Reason.GRACE``), at most every 10 s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from celery_baton.errors import StoreUnavailable
from celery_baton.worker.holding import BACKOFF_START, Delivery, Holding
from celery_baton.worker.releasing import Releasing
from celery_baton.worker.verdict import Reason, Wait

logger = logging.getLogger("celery_baton.worker")

STORE_KEY = "<store>"  # the wait queue of requests held because the store is down
BACKOFF_MAX = 10.0


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
    ) -> None:
        self.on_store_error = on_store_error
        self.holding = holding
        self.releasing = releasing
        self.new_owner = new_owner
        self.run_unguarded = run_unguarded
        self._down_until = 0.0
        self._grace_logged = -1e9

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
        self._down_until = 0.0
        delivery.backoff = BACKOFF_START

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
        logger.warning(
            "store unavailable, holding %s[%s], retry in %.2fs: %s",
            request.name,
            request.id,
            delay,
            error,
        )
        self.holding.hold(delivery, Wait(Reason.STORE_DOWN, STORE_KEY, delay))

    def warn_grace(self, delay: float, now: float) -> None:
        """The gate refused for the grace of a new (or emptied) store."""
        if now - self._grace_logged > 10:
            self._grace_logged = now
            logger.warning(
                "baton: the store is new or lost its data (no store epoch, or a "
                "replica was promoted): no new lease for %.1fs, while running tasks "
                "write theirs back (grace)",
                delay,
            )
