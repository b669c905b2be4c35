"""A held request's prefetch slot, given back where the prefetch of a consumer is fixed.

Held requests raise the prefetch count like ETA tasks do (``worker/holding.py``), so the
window the worker needs for work it can run stays open. That raise reaches the broker
only where the prefetch is one count for the channel: kombu's virtual transports (Redis,
SQS) and RabbitMQ 3's global QoS on classic queues. Where RabbitMQ applies a prefetch
per consumer (a quorum queue; every queue on RabbitMQ 4, where kombu asks no global
QoS), a new ``basic.qos`` applies only to consumers created after it: the consumer
keeps the count it started with, held requests fill it, and nothing else arrives until
they leave (200 held requests of a 2/s task kept plain tasks out for 96 s).

So the task consumer is opened again: the channel's prefetch is set, its consumers are
cancelled and created anew. A cancelled consumer's deliveries stay the channel's (they
are acked or rejected as before, AMQP 0-9-1 ``basic.cancel``); the broker counts only
the new consumer's own deliveries against its prefetch, so the held ones no longer take
its window. Nothing goes back to the queue: no redelivery, no quorum queue delivery
count (``x-delivery-limit``), no change of order.

It is opened again when held requests took more than half of the window (counted
against the consumer that delivered them) and the worker has less than that half of
other work waiting for the pool: a worker with work to do does not fetch more, as under
a global prefetch. The new consumer's prefetch is the window and half of it again, so a
backlog of holds opens it once per window's worth of them, not once per hold.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from celery_baton import internals

logger = logging.getLogger("celery_baton.worker")

#: How long a worker whose held requests took its window waits before it looks again
#: whether its other work left room (no hold or release happened meanwhile).
RECHECK = 0.5


def headroom(window: int) -> int:
    """Half the window, at least one: how far held requests may eat into a consumer's
    window before it is opened again, and how much more than the window the new one
    gets."""
    return max(1, (window + 1) // 2)


def new_prefetch(*, prefetch: int, taken: int, window: int, waiting: int) -> int | None:
    """The prefetch to open the consumer again with, or None to keep it.

    ``prefetch``: the consumer's own; ``taken``: held requests it delivered, still held;
    ``window``: what Celery wants open for runnable work (concurrency x multiplier);
    ``waiting``: other requests in the worker waiting for a pool process."""
    share = headroom(window)
    if prefetch - taken > window - share:
        return None  # its window is still mostly open
    if waiting >= window - share:
        return None  # the worker has work: it takes no more now
    return window + share


def single_active_queues(queues: Iterable[Any]) -> list[str]:
    """The names of ``queues`` declared with ``x-single-active-consumer``: opening their
    consumer again would hand the active role to another worker."""
    return [
        queue.name
        for queue in queues
        if (getattr(queue, "queue_arguments", None) or {}).get("x-single-active-consumer")
    ]


def consumer_tag(message: Any) -> str | None:
    tag = (getattr(message, "delivery_info", None) or {}).get("consumer_tag")
    return tag if isinstance(tag, str) else None


class ConsumerWindow:
    """Opens the task consumer again when held requests took its fixed prefetch window.

    ``held()`` and ``left()`` are called by ``Holding`` for every held request that
    raised the prefetch count; ``start()`` at every consumer start. Inactive (every
    call returns at once) unless the broker applies the prefetch per consumer.
    """

    def __init__(
        self,
        *,
        waiting: Callable[[], int],
        held_messages: Callable[[], Iterable[Any]],
    ) -> None:
        self.waiting = waiting  # other requests waiting for a pool process
        self.held_messages = held_messages  # the messages of every held request
        self.active = False
        self.consumer: Any = None
        self.prefetch = 0  # the current consumer's own prefetch
        self.taken = 0  # held requests it delivered, still held
        self.tags: frozenset[str] = frozenset()
        self.reopened = 0  # how many times, for the log and the tests
        self._due_now = False  # an opening is scheduled on the loop's next turn
        self._recheck_due = False  # a look again is scheduled
        self._opening = False
        self._warned = self._told = False  # each said once per worker

    # -- at every consumer start ----------------------------------------------------

    def start(self, consumer: Any) -> None:
        """The consumer (re)started with a new task consumer at Celery's prefetch."""
        self.consumer = consumer
        self.active = False
        self._due_now = self._recheck_due = self._opening = False
        window = int(getattr(consumer, "initial_prefetch_count", 0) or 0)
        if window <= 0 or internals.task_qos_global(consumer) is not False:
            return  # no prefetch limit, or one the raise reaches (global, virtual)
        task_consumer = getattr(consumer, "task_consumer", None)
        sac = single_active_queues(getattr(task_consumer, "queues", None) or ())
        tags = internals.consumer_tags(task_consumer)
        if sac or tags is None:
            if not self._warned:
                self._warned = True
                logger.warning(
                    "baton: the broker keeps each consumer's prefetch count (%d) fixed%s: "
                    "held requests take its place, and while %d are held this worker "
                    "receives nothing else",
                    window,
                    f" and {', '.join(sac)} has a single active consumer" if sac else "",
                    window,
                )
            return
        self.active = True
        self.prefetch = window
        self.tags = tags
        self.taken = 0
        if not self._told:
            self._told = True
            logger.info(
                "baton: the broker keeps each consumer's prefetch count fixed: the task "
                "consumer is opened again when held requests take half of its window (%d)",
                window,
            )

    # -- from Holding ---------------------------------------------------------------

    def held(self, message: Any) -> None:
        if self.active and not self.tags:
            # Celery's loop consumes after every step started: the first tags are read
            # at the first hold.
            self.tags = internals.consumer_tags(self.consumer.task_consumer) or frozenset()
        if self.active and consumer_tag(message) in self.tags:
            self.taken += 1
            self._check()

    def left(self, message: Any) -> None:
        if self.active and consumer_tag(message) in self.tags:
            self.taken -= 1
            self._check()

    # -- opening again ----------------------------------------------------------------

    def _check(self) -> None:
        if self._opening or self._due_now:
            return
        window = int(self.consumer.initial_prefetch_count or 0)
        share = headroom(window)
        if self.prefetch - self.taken > window - share:
            return
        if self.waiting() < window - share:
            # Not from inside a gate answer or a delivery: on the loop's next turn.
            self._due_now = True
            self.consumer.timer.call_after(0.0, self._open_again, priority=4)
        elif not self._recheck_due:
            # Busy now: look again when a hold or a release happens, or at the latest
            # after RECHECK (its other work may start meanwhile, which tells nobody).
            self._recheck_due = True
            self.consumer.timer.call_after(RECHECK, self._recheck, priority=4)

    def _recheck(self) -> None:
        self._recheck_due = False
        if self.active:
            self._check()

    def _open_again(self) -> None:
        # kombu's timer swallows exceptions: catch everything, the worker must go on.
        self._due_now = False
        if not self.active:
            return
        try:
            window = int(self.consumer.initial_prefetch_count or 0)
            prefetch = new_prefetch(
                prefetch=self.prefetch, taken=self.taken, window=window, waiting=self.waiting()
            )
            if prefetch is None:
                self._check()  # busy meanwhile (or its window opened): look again later
                return
            self._reopen(prefetch)
        except Exception as exc:
            self.active = False  # until the next consumer start
            logger.warning(
                "baton: opening the task consumer again failed (%r); held requests keep "
                "their place in its prefetch window until the worker reconnects",
                exc,
            )

    def _reopen(self, prefetch: int) -> None:
        task_consumer = self.consumer.task_consumer
        self._opening = True
        try:
            # Deliveries to the old consumers may still arrive while it is cancelled
            # (and be held: they count against it, not the new one).
            task_consumer.qos(prefetch_count=prefetch, apply_global=False)
            task_consumer.cancel()
            task_consumer.consume()
        finally:
            self._opening = False
        tags = internals.consumer_tags(task_consumer)
        if tags is None:
            raise RuntimeError("the new consumer tags cannot be read")
        self.tags = tags
        self.prefetch = prefetch
        self.taken = sum(1 for message in self.held_messages() if consumer_tag(message) in tags)
        self.reopened += 1
        logger.debug(
            "baton: task consumer opened again with prefetch %d (%d held requests took "
            "the last one's window; %d times so far)",
            prefetch,
            self.taken,
            self.reopened,
        )
