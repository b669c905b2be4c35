"""The end of a store-wide hold: the backlog past the worker's window goes back to the
broker, so that every worker takes from it.

While the store's grace lasts (``verdict.Reason.GRACE``: new, or lost its data) or the
store is down (``Reason.STORE_DOWN``, ``baton_on_store_error="hold"``), every guarded
delivery is held, and held deliveries raise the prefetch count (``worker/holding.py``):
the worker that is up takes the whole backlog from the broker. Kept, it ran all of it
at its own concurrency when the hold ended, while a worker started meanwhile (or busy
until then) found the queue empty and idled: 160 of 160 calls on one worker of two
(tests/worker/test_hold_spread.py).

So when the hold ends (a grace-held request's first other answer, the store answering
again), the worker keeps what a plain Celery worker would have reserved -- its prefetch
window, concurrency x prefetch multiplier -- and hands the rest back to the broker, in
the order they would have been asked (priority, then arrival), as the hold horizon does
(``reject(requeue=True)``: same id, headers and retry count). None of them reached the
pool, so none runs twice; each goes back once, to be delivered to whichever worker has
room. Those in the middle of an ask, or waiting for a pool process, are kept (and
count against the window); the others kept join the line for a pool process at once,
oldest first. A worker without a prefetch limit (multiplier 0) keeps all: it takes
everything without celery-baton too.

Requests whose turn is judged among the requests held are neither handed back nor
asked for here: a beat slot with a misfire policy, a task with ``fair_key``, a call in
a per-key flow (see ``_judged_here``). They stay in their wait queues, and the head of
each queue asks now, as after any other hold (``Holding.spread``). Asked for all at
once they lost what their queues are for: the kept requests join one line for a pool
process, oldest first, so a big tenant's whole backlog asked before a small tenant's
first request, and the store, which learns that a tenant waits only from its asks,
gave every slot to the big one meanwhile (tests/limits/test_fairness.py's grace case
under twice the cores in load: 96 of tenant A's runs after B's requests were all in
the workers, the bound 60).

Where the broker puts a rejected message: RabbitMQ at its place in a classic queue, and
a quorum queue's grouped by the consumer it was delivered to (not in order: the task
consumer is opened again for held requests, ``transport/consumer_window.py``); kombu's
Redis transport behind the messages waiting in the queue (none, unless the worker was
past ``baton_hold_max``), in the order handed back.

The grace's end is learned from a grace-held request's next answer, which it asks for
only once a pool process is free: a worker whose pool is busy with other work when the
grace ends hands back when a process frees, not before.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from celery_baton.core.policy.headers import BEAT_SLOT_HEADER, MISFIRE_HEADER
from celery_baton.worker.holding import Delivery, Holding
from celery_baton.worker.verdict import Reason

logger = logging.getLogger("celery_baton.worker")


def split(
    held: Iterable[Delivery],
    reason: Reason,
    keep: int,
    rank: Callable[[Any], float | None] = lambda request: None,
) -> tuple[list[Delivery], list[Delivery]]:
    """Of the deliveries ``held`` for ``reason``, in the order they would be asked (a
    higher ``rank`` first, then arrival): those kept, the first ``keep``, and those to
    hand back, the rest. One that is asking, or waiting for (or holding) a pool
    process, is kept and counts, but is not among those returned. One whose turn is
    judged among the held (a beat slot's misfire, ``fair_key``, a per-key flow) is in
    neither and does not count: it stays in its wait queue (``_judged_here``)."""
    waiting = [d for d in held if d.held and d.held_for is reason]
    busy = [d for d in waiting if _busy(d)]
    others = sorted(
        (d for d in waiting if not _busy(d) and not _judged_here(d)),
        key=lambda d: (-(rank(d.request) or 0.0), d.since),
    )
    kept = max(0, keep - len(busy))
    return others[:kept], others[kept:]


def judged_here(held: Iterable[Delivery], reason: Reason) -> list[Delivery]:
    """The deliveries ``held`` for ``reason`` that stay in their wait queues."""
    return [d for d in held if d.held and d.held_for is reason and _judged_here(d)]


def _judged_here(delivery: Delivery) -> bool:
    """A delivery whose turn is judged among the requests the worker holds, left in its
    wait queue (its queue's head asks, not every one at once):

    * a beat slot with a misfire policy: a held slot is judged by it when admitted
      (coalesced into a later slot, or skipped, ``worker/misfire.py``), a judgement only
      the worker that held it makes; back through the broker it is a new delivery and
      runs however stale (a 1 s entry held for a grace: 11 ticks within one second).
      Most are not run at all, so keeping them keeps no work from another worker.
    * a task with ``fair_key``: its turns alternate between the tenants the workers
      hold (``worker/wait_queues.py``); handed back, a small tenant's requests went
      behind a big one's backlog in the broker's queue, in arrival order, and waited
      for all of it (tests/limits/test_fairness.py, from a grace's or an outage's end:
      B done 13 and 17 s after its publish). Only one request per tenant asks at a
      time: the store alternates between the tenants whose heads asked.
    * a call in a per-key flow (``ordered``, debounce): its order is judged against
      its key's publish stamps, and one handed back behind later calls would hold them
      up to the gap timeout."""
    plan = delivery.plan
    if plan.fair_limits or plan.flow_key is not None:
        return True
    headers = getattr(delivery.request, "request_dict", None) or {}
    return headers.get(MISFIRE_HEADER) is not None and headers.get(BEAT_SLOT_HEADER) is not None


def _busy(delivery: Delivery) -> bool:
    return (
        delivery.asking
        or delivery.waiting_slot
        or delivery.slot
        or delivery.reserved_start
        or delivery.ahead is not None
    )


class HoldEnd:
    """Hands back, at the end of a store-wide hold, what the worker cannot start soon.

    ``ended(reason, why)`` is called on the consumer's loop when the hold for ``reason``
    ended; the deliveries go back on the loop's next turn (the answer that told may be
    about one of them, still being applied) through ``hand_back(delivery, why)``, and
    those kept are asked for through ``ask(delivery)``, each in turn: in their queue
    only its head asks, and the one behind it would ask only once the head started,
    behind every request delivered meanwhile (the oldest of the backlog would run last).
    The queues of those judged among the held (``_judged_here``) are woken instead: their
    heads ask, and only they.
    """

    def __init__(
        self,
        holding: Holding,
        *,
        hand_back: Callable[[Delivery, str], None],
        ask: Callable[[Delivery], None],
        generation: Callable[[], int],
    ) -> None:
        self.holding = holding
        self.hand_back = hand_back
        self.ask = ask
        self.generation = generation
        self._due: dict[Reason, str] = {}
        self.handed_back = 0  # in all, for the tests and the log

    def restart(self) -> None:
        """A consumer restart: an end still due went with a cleared timer (Celery 5.3),
        and its mark would refuse every later end of its reason. The requests it was
        for were forgotten with the connection (their messages come back)."""
        self._due.clear()

    def ended(self, reason: Reason, why: str) -> None:
        if reason in self._due:
            return
        self._due[reason] = why
        self.holding.consumer.timer.call_after(0.0, self._end, (reason,), priority=4)

    def window(self) -> int:
        """What a plain worker reserves: Celery's prefetch count at the consumer's start
        (concurrency x prefetch multiplier; 0: no limit)."""
        return int(getattr(self.holding.consumer, "initial_prefetch_count", 0) or 0)

    def _end(self, reason: Reason) -> None:
        # kombu's timer swallows exceptions: catch everything, the worker must go on
        # (what is not handed back stays held and runs here, as before).
        why = self._due.pop(reason, "")
        began = time.monotonic()
        try:
            keep = self.window()
            if keep <= 0:
                return
            with self.holding.lock:
                generation = self.generation()
                held = [d for d in self.holding.held_deliveries() if d.generation == generation]
                kept, back = split(held, reason, keep, self.holding.rank)
                for delivery in back:
                    self.holding.release(delivery)
                # Their prefetch slots first: a broker that applies the lower count only
                # later (RabbitMQ) would deliver them to this worker again at once.
                try:
                    self.holding.consumer.qos.update()
                except Exception as exc:  # the broker's: they go back all the same
                    logger.warning("baton: lowering the prefetch count failed: %r", exc)
                for delivery in back:
                    try:
                        self.hand_back(delivery, why)
                    except Exception:  # one that fails must not keep the others here
                        logger.exception(
                            "baton: handing back %s[%s] failed",
                            delivery.request.name,
                            delivery.request.id,
                        )
                for delivery in kept:  # in their order: into the line for a pool process
                    if delivery.held and not _busy(delivery):
                        self.ask(delivery)
                # The others' queues: each head asks now (no jitter: the hold is over).
                for queue_key in dict.fromkeys(d.queue_key for d in judged_here(held, reason)):
                    if queue_key is not None:
                        self.holding.arm(queue_key, 0.0, jitter=False)
                left = sum(1 for d in self.holding.held_deliveries() if d.held_for is reason)
            if back:
                self.handed_back += len(back)
                # The time says how long the loop was busy with it (a reject is a
                # broker round trip or more: a transaction on kombu's Redis transport).
                # Each id is named, as held_return names those it puts back: a message
                # on its way back when the broker dies can be lost in kombu's Redis
                # transport (docs/failure.md), and the log then says which were.
                logger.info(
                    "baton: %s: %d held requests handed back to the broker, for every "
                    "worker to take, in %.2fs; %d kept (this worker's prefetch window is "
                    "%d): %s",
                    why,
                    len(back),
                    time.monotonic() - began,
                    left,
                    keep,
                    ", ".join(d.request.id for d in back),
                )
        except Exception:
            logger.exception("baton: handing back held requests failed (%s)", why)
