"""Starting: an admitted delivery goes to the pool, holding what the gate granted.

Its leases are attached to the request (given back by ``worker/request.py`` when it
ends, whichever way) and kept alive by the lease book; its fence is put in the request.
It goes on the pool slot it was asked on (``worker/pool_slots.py``); a reserved rate
slot (``Start.start_after``, at most one interval ahead) keeps that pool slot until its
instant, so that the run starts then, not whenever a process frees up.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from celery_baton import metrics
from celery_baton.core.leases import LeaseBook
from celery_baton.worker.events import DecisionEvents
from celery_baton.worker.holding import Delivery, Holding
from celery_baton.worker.pool.context import FENCE_FIELD
from celery_baton.worker.pool.run_end import mark as mark_run_end
from celery_baton.worker.pool_slots import PoolSlots
from celery_baton.worker.releasing import Releasing
from celery_baton.worker.request import attach
from celery_baton.worker.verdict import Start

logger = logging.getLogger("celery_baton.worker")


class Starting:
    """Hands admitted deliveries to the pool through ``slots``; ``generation()`` is the
    admission's current generation (a delivery of an older one was forgotten)."""

    def __init__(
        self,
        consumer: Any,
        slots: PoolSlots,
        *,
        holding: Holding,
        releasing: Releasing,
        book: LeaseBook,
        stats: dict[str, int],
        generation: Callable[[], int],
        events: DecisionEvents,
    ) -> None:
        self.events = events
        self.consumer = consumer
        self.slots = slots
        self.holding = holding
        self.releasing = releasing
        self.book = book
        self.stats = stats
        self.generation = generation

    def start(self, delivery: Delivery, start: Start, *, guarded: bool = True) -> None:
        request = delivery.request
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
        self.events.admitted(delivery, guarded=guarded)
        self.stats["admitted"] += 1
        metrics.admissions.labels(request.name).inc()
        if start.start_after > 0:
            # A reserved rate slot: hold it, and its pool slot, until the slot's instant.
            self.holding.hold_reserved(delivery)
            delivery.reserved_start = True
            self.consumer.timer.call_after(
                start.start_after, self._dispatch, (delivery,), priority=5
            )
            return
        self.holding.release(delivery)
        if guarded:
            self.releasing.handed(request)
        self._to_pool(delivery)

    def _to_pool(self, delivery: Delivery) -> None:
        if delivery.slot:
            delivery.slot = False
            self.slots.run(delivery.request)
        else:  # never asked on a slot of its own: through Celery's own path
            self.slots.plain(delivery.request)

    def _dispatch(self, delivery: Delivery) -> None:
        try:
            with self.holding.lock:
                delivery.reserved_start = False
                if delivery.generation != self.generation():
                    # Forgotten (the connection was lost; the broker redelivers it): it
                    # will not run here, so give back what it was granted.
                    self.releasing.give_back(delivery.plan)
                    if delivery.slot:
                        delivery.slot = False
                        self.slots.give_back()
                    return
                self.holding.release(delivery)
                self.releasing.handed(delivery.request)
                self._to_pool(delivery)
        except Exception:
            logger.exception(
                "baton: dispatching %s[%s] failed", delivery.request.name, delivery.request.id
            )
