"""Held messages a crashed broker could not take back, put back once it is reachable.

A request celery-baton holds is an unacknowledged message, which kombu's Redis
transport keeps in the broker's unacked index until it is acked. When the connection is
lost, the channel's close puts its unacked messages back in their queues, but only if
the broker answers. When the broker itself died, they stay in the index, and kombu
brings them back only after the ``visibility_timeout`` (an hour by default): a held
request, which had not even started, waited that long. So the worker remembers the held
deliveries it dropped with the connection and, once connected again (before it
consumes), puts back those that can only still be its own:

* the old channel's close could not restore them (they are still in its ``_delivered``):
  a message it did restore may already be another worker's, under the same delivery tag
  (kombu tags a message when it is published, not when it is delivered);
* received (or its claim renewed: ``held_renewal``) less than half the visibility
  timeout ago: an older one may have been
  restored by another worker's visibility scan and delivered again, under the same tag;
* still in the unacked index, checked and moved in one transaction (kombu's
  ``restore_by_tag``): of two that put the same message back, one does.

None of them started (a held request never reaches the pool), so no run is repeated.
kombu's Redis transport only: AMQP brokers requeue a dead connection's messages
themselves.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Container, Iterable, Sequence
from typing import Any

from celery_baton import internals
from celery_baton.worker.holding import Delivery

logger = logging.getLogger("celery_baton.worker")


def returnable(
    held: Iterable[tuple[str | None, float]],
    unrestored: Container[str],
    now: float,
    visibility: float,
) -> list[str]:
    """The delivery tags to put back, from ``(tag, claimed at)`` pairs (monotonic
    seconds: received, or renewed since): tags the old channel could not restore,
    claimed within half of ``visibility``."""
    return [
        tag for tag, since in held if tag and tag in unrestored and now - since < visibility / 2
    ]


def delivery_tag(delivery: Delivery) -> str | None:
    tag = getattr(getattr(delivery.request, "message", None), "delivery_tag", None)
    return tag if isinstance(tag, str) else None


class HeldReturn:
    """Remembers the held deliveries a lost connection dropped; puts them back later."""

    def __init__(self, visibility: float) -> None:
        self.visibility = visibility
        self._dropped: list[tuple[str | None, float]] = []
        self._task_ids: dict[str, str] = {}  # delivery tag -> task id, for the log
        self._old_channel: Any = None

    def remember(self, forgotten: Sequence[Delivery], channel: Any) -> None:
        """At the consumer's stop after a lost connection: ``channel`` is the old one."""
        self._dropped += [(delivery_tag(d), d.claimed_at) for d in forgotten]
        self._task_ids.update((delivery_tag(d) or "", d.request.id) for d in forgotten)
        if forgotten:
            self._old_channel = channel

    def put_back(self, channel: Any) -> int:
        """At the consumer's start, connected again, before it consumes: put back what
        may be (through ``channel``, the new one); returns how many were put back."""
        dropped, self._dropped = self._dropped, []
        task_ids, self._task_ids = self._task_ids, {}
        old, self._old_channel = self._old_channel, None
        if not dropped:
            return 0
        unrestored = internals.unrestored(old)
        restore = internals.restore_by_tag(channel)
        if unrestored is None or restore is None:
            return 0
        tags = returnable(dropped, unrestored, time.monotonic(), self.visibility)
        done = 0
        for tag in tags:
            try:
                restore(tag)
            except Exception as exc:
                logger.warning(
                    "baton: %d held messages not put back in their queues (%s); the "
                    "broker's visibility timeout brings them back",
                    len(tags) - done,
                    exc,
                )
                break
            # Never again by the old channel (kombu restores what is left there when
            # it is collected): by now the message may be another worker's.
            unrestored.pop(tag, None)
            done += 1
        if done:
            # Each id is named: a message being delivered again when the broker dies
            # can be lost in kombu's Redis transport (docs/failure.md), and the log
            # then says which ones were on their way.
            logger.info(
                "baton: %d held messages put back in their queues (the broker could not "
                "take them back when the connection was lost): %s",
                done,
                ", ".join(task_ids.get(tag, "?") for tag in tags[:done]),
            )
        return done
