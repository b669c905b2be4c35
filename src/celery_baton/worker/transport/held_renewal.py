"""Held messages kept past the hold horizon: their claim on the broker renewed.

A held request is an unacknowledged message. kombu's Redis transport records when it was
delivered (its score in the broker's unacked index) and a visibility scan on any worker
puts it back in its queue once that is ``visibility_timeout`` ago. So a held request
was handed back at the hold horizon (at most half the timeout): back in the queue,
fetched again at once (Redis delivers it to whoever asks), held again. Every such round
trip is a moment where a broker crash can lose the message (kombu pops it before it
records it unacked: docs/failure.md), and a held message met one per horizon.

Here the delivery time is written again instead (``internals.restamp_unacked``): the
message stays with the worker, unacked, and the scan leaves it alone for another
timeout. Only a message no longer in the unacked index is handed back (a stalled
worker's message that a scan already put back: the hand-back removes nothing there and
restores nothing twice); one the broker could not be asked about stays held and is
renewed at the next try. On other transports the horizon hands back as before:
RabbitMQ's deliveries have no timeout to renew, and its ``consumer_timeout`` (30 min by
default) closes a channel that keeps one longer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from celery_baton import internals
from celery_baton.worker.holding import Delivery

logger = logging.getLogger("celery_baton.worker")


def delivery_tag(delivery: Delivery) -> str | None:
    tag = getattr(getattr(delivery.request, "message", None), "delivery_tag", None)
    return tag if isinstance(tag, str) else None


class HeldRenewal:
    """Renews held messages' claims on kombu's Redis broker."""

    def __init__(self) -> None:
        self.renewed = 0  # claims renewed, for the log and the tests

    def renew(self, deliveries: Iterable[Delivery]) -> list[Delivery]:
        """Renew the claim of each of ``deliveries``; returns those that are no longer
        in the unacked index (to hand back). When the broker does not answer, none is
        returned: they stay held and are renewed at the next try (a lost connection
        restarts the consumer, and ``held_return`` takes over)."""
        by_channel: dict[int, tuple[object, list[tuple[Delivery, str]]]] = {}
        gone: list[Delivery] = []
        for delivery in deliveries:
            channel = getattr(getattr(delivery.request, "message", None), "channel", None)
            tag = delivery_tag(delivery)
            if channel is None or tag is None:
                gone.append(delivery)  # nothing to renew: handed back as before
                continue
            by_channel.setdefault(id(channel), (channel, []))[1].append((delivery, tag))
        for channel, held in by_channel.values():
            gone += self._renew_on(channel, held)
        return gone

    def _renew_on(self, channel: object, held: list[tuple[Delivery, str]]) -> list[Delivery]:
        restamp = internals.restamp_unacked(channel)
        if restamp is None:
            return [delivery for delivery, _ in held]
        now_wall, now = time.time(), time.monotonic()  # kombu scores by the wall clock
        try:
            present = restamp([tag for _, tag in held], now_wall)
        except Exception as exc:
            logger.warning(
                "baton: renewing %d held messages on the broker failed (%r); tried again "
                "in a moment",
                len(held),
                exc,
            )
            return []
        gone = []
        for (delivery, _), there in zip(held, present, strict=True):
            if there:
                delivery.claimed_at = now
                self.renewed += 1
            else:
                gone.append(delivery)
        return gone


def due(deliveries: Iterable[Delivery], now: float, horizon: float) -> list[Delivery]:
    """The held deliveries whose claim is ``horizon`` old or more."""
    return [d for d in deliveries if d.held and now - d.claimed_at >= horizon]
