"""Starting: an admitted delivery goes to the pool, holding what the gate granted.

Its leases are attached to the request (given back by ``worker/request.py`` when it
ends, whichever way) and kept alive by the lease book; its fence is put in the request.
It goes on the pool slot it was asked on (``worker/pool_slots.py``); a reserved rate
slot (``Start.start_after``, at most one interval ahead) keeps that pool slot until its
instant, so that the run starts then, not whenever a process frees up.

A rate grant is for a moment: the store spent the token when it answered, for a start
then (or at the reserved instant). If the consumer's loop stood still meanwhile (a
broker call that blocks it, a stopped process), the answer is read, or the reserved
instant comes round, late: started now, the run would start together with the grants
that follow. Such a stale grant (``STALE_GRANT``) is given back and asked again: its
token is lost, which errs on the side of the limit. After the hand-over the pool
process judges it again, at the body's start (``worker/pool/rate_grant.py``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from celery_baton import metrics
from celery_baton.core.conditions import Rate, WeightedRate
from celery_baton.core.leases import LeaseBook
from celery_baton.worker.events import DecisionEvents
from celery_baton.worker.holding import Delivery, Holding
from celery_baton.worker.pool import cancel_start
from celery_baton.worker.pool.context import FENCE_FIELD
from celery_baton.worker.pool.rate_grant import STALE_GRANT
from celery_baton.worker.pool.rate_grant import mark as mark_rate_grant
from celery_baton.worker.pool.run_end import mark as mark_run_end
from celery_baton.worker.pool.throttle_start import mark as mark_throttle
from celery_baton.worker.pool_slots import PoolSlots
from celery_baton.worker.releasing import Releasing
from celery_baton.worker.request import attach
from celery_baton.worker.verdict import Reason, Start, Wait

logger = logging.getLogger("celery_baton.worker")


def rate_key(delivery: Delivery) -> str | None:
    """The key of ``delivery``'s first rate condition (its own or a named limit's)."""
    for condition in delivery.plan.conditions:
        if isinstance(condition, Rate | WeightedRate):
            return condition.key
    return None


class Starting:
    """Hands admitted deliveries to the pool through ``slots``."""

    def __init__(
        self,
        consumer: Any,
        slots: PoolSlots,
        *,
        holding: Holding,
        releasing: Releasing,
        book: LeaseBook,
        stats: dict[str, int],
        events: DecisionEvents,
        cancelled: Callable[[Any], str | None] = lambda request: None,
        drop_cancelled: Callable[[Delivery, str], None] = lambda delivery, why: None,
    ) -> None:
        self.events = events
        #: Why a request is cancelled by what this worker knows (None: it is not), and
        #: how a held one that is leaves (Admission: released, its ordered turn passed,
        #: revoked).
        self.cancelled = cancelled
        self.drop_cancelled = drop_cancelled
        self.consumer = consumer
        self.slots = slots
        self.holding = holding
        self.releasing = releasing
        self.book = book
        self.stats = stats

    def start(self, delivery: Delivery, start: Start, *, guarded: bool = True) -> None:
        request = delivery.request
        now = time.monotonic()
        if guarded and self._stale(delivery, now - delivery.asked_at):
            return
        delivery.start_due = now + start.start_after
        if guarded:
            attach(request, self.releasing, delivery.policy, delivery.plan)
            self.book.add(
                delivery.plan.owner,
                delivery.plan.leases,
                epoch=start.epoch,
                claim=delivery.plan.kept_claim,
                labels=delivery.plan.labels,
            )
            if start.fence:
                request.request_dict[FENCE_FIELD] = start.fence
            mark_run_end(request.request_dict, delivery.policy, delivery.plan)
            due = delivery.start_due if start.start_after > 0 else delivery.asked_at
            mark_rate_grant(
                request.request_dict, delivery.plan.conditions, delivery.plan.owner, due
            )
            cancel_start.mark(request.request_dict, due)  # a late one asks about a cancel
            mark_throttle(
                request.request_dict,
                delivery.policy.flow,
                delivery.plan.flow_key,
                request.id,
                delivery.flow_asked_at,
            )
        if start.start_after > 0:
            logger.debug(
                "%s[%s] granted a slot %.3fs ahead", request.name, request.id, start.start_after
            )
            # A reserved rate slot: hold it, and its pool slot, until the slot's instant.
            self.holding.hold_reserved(delivery)
            delivery.reserved_start = True
            self.consumer.timer.call_after(
                start.start_after, self._dispatch, (delivery,), priority=5
            )
            return
        logger.debug(
            "%s[%s] to the pool (granted %.3fs after its ask)",
            request.name,
            request.id,
            now - delivery.asked_at,
        )
        self._count_admitted(delivery, guarded=guarded)
        self.holding.release(delivery)
        if guarded:
            self.releasing.handed(request)
        self._to_pool(delivery)

    def _count_admitted(self, delivery: Delivery, *, guarded: bool) -> None:
        """Counted when it goes to the pool: a reserved slot found stale at its instant
        is asked again, and counted once, when its fresh grant starts."""
        self.events.admitted(delivery, guarded=guarded)
        self.stats["admitted"] += 1
        metrics.admissions.labels(delivery.request.name).inc()

    def _stale(self, delivery: Delivery, late: float) -> bool:
        """Whether ``delivery``'s grant came ``late`` seconds ago and holds a rate token:
        then it is given back and the delivery held to be asked again at once."""
        if late <= STALE_GRANT:
            return False
        key = rate_key(delivery)
        if key is None:
            return False
        self.stats["stale_grants"] = self.stats.get("stale_grants", 0) + 1
        logger.info(
            "%s[%s] granted %.2fs ago (the worker's loop stood still): asking again, "
            "not starting together with later grants",
            delivery.request.name,
            delivery.request.id,
            late,
        )
        self.releasing.give_back(delivery.plan)
        self.holding.hold(delivery, Wait(Reason.RATE, key, 0.0, jitter=False, quiet=True))
        return True

    def _to_pool(self, delivery: Delivery) -> None:
        if delivery.slot:
            delivery.slot = False
            self.slots.run(delivery.request)
        else:  # never asked on a slot of its own: through Celery's own path
            self.slots.plain(delivery.request)

    def _give_back_slot(self, delivery: Delivery) -> None:
        """A reserved delivery that will not go to the pool now gives its slot back."""
        if delivery.slot:
            delivery.slot = False
            self.slots.give_back()

    def forgotten(self, deliveries: list[Delivery]) -> None:
        """The broker connection was lost (``Admission.forget_held``): a delivery waiting
        for its reserved rate slot's instant will not start here (its message goes to
        others), so its grant and its pool slot are given back now, not by ``_dispatch``:
        Celery 5.3 clears the consumer's timer when the connection is lost
        (``Consumer.on_close``: ``self.timer.clear()``; 5.6 and 5.7 keep it), so that
        call never came, and each such delivery kept its pool slot for good. Once every
        slot was kept so, each later guarded request waited for a pool process forever
        (never asked, never run, its message unacked until kombu's visibility scan, every
        100 s before kombu 5.7, gave it to a worker again): test_held_broker_kill.py on
        Celery 5.3. Where the timer is kept, ``_dispatch`` finds the delivery settled."""
        for delivery in deliveries:
            if delivery.reserved_start:
                delivery.reserved_start = False
                self.releasing.give_back(delivery.plan)
                self._give_back_slot(delivery)

    def _dispatch(self, delivery: Delivery) -> None:
        try:
            with self.holding.lock:
                if not delivery.reserved_start:
                    # Forgotten (the connection was lost; the broker redelivers it): its
                    # grant and pool slot were given back then (forgotten, which every
                    # reserved delivery passes through as the generation moves on).
                    return
                delivery.reserved_start = False
                if self._stale(delivery, time.monotonic() - delivery.start_due):
                    self._give_back_slot(delivery)  # asked again on a slot of its own
                    return
                why = self.cancelled(delivery.request)
                if why is not None or not delivery.held:
                    # Cancelled while it waited for its slot's instant: a cancel notice
                    # that came meanwhile may have dropped it already (not held), or be
                    # known but not yet acted on. It does not start; its token stays
                    # spent (the limit's side of the error).
                    self.releasing.give_back(delivery.plan)
                    self._give_back_slot(delivery)
                    if why is not None and delivery.held:
                        self.drop_cancelled(delivery, why)
                    return
                logger.debug(
                    "%s[%s] to the pool at its reserved instant",
                    delivery.request.name,
                    delivery.request.id,
                )
                self._count_admitted(delivery, guarded=True)
                self.holding.release(delivery)
                self.releasing.handed(delivery.request)
                self._to_pool(delivery)
        except Exception:
            logger.exception(
                "baton: dispatching %s[%s] failed", delivery.request.name, delivery.request.id
            )
