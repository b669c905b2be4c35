"""Held messages a crashed broker could not take back, kept once it is reachable.

A request celery-baton holds is an unacknowledged message, which kombu's Redis
transport keeps in the broker's unacked index until it is acked. When the connection is
lost, the channel's close puts its unacked messages back in their queues, but only if
the broker answers. When the broker itself died, they stay in the index, and kombu
brings them back only after the ``visibility_timeout`` (an hour by default): a held
request, which had not even started, waited that long. So the worker remembers the held
deliveries it dropped with the connection and, once connected again (before it
consumes), keeps those that can only still be its own:

* the old channel's close could not restore them (they are still in its ``_delivered``):
  a message it did restore may already be another worker's, under the same delivery tag
  (kombu tags a message when it is published, not when it is delivered);
* received (or its claim renewed: ``held_renewal``) less than half the visibility
  timeout ago: an older one may have been
  restored by another worker's visibility scan and delivered again, under the same tag;
* still in the unacked index, checked and claimed in one transaction: of two that
  take the same message, one does.

Each is kept: taken into the new channel without leaving the unacked index (its
delivery time written anew) and handed to the consumer as a new delivery, so it is held
again without passing through its queue. Putting it back in its queue, as before, made
the worker fetch it again, and kombu pops a message before it records it unacked: a
second broker crash right after the restart could lose it there (docs/failure.md).
Where kombu lacks what keeping needs, they are put back (``restore_by_tag``).

One the broker never recorded unacked (its record was refused, or in flight when the
broker died: worker/transport/broker_writes.py) is in neither the index nor its queue:
this worker alone has it, and it is put back in its queue from the record the worker
kept (tests/transport/test_unrecorded_held.py).

None of them started (a held request never reaches the pool), so no run is repeated.
kombu's Redis transport only: AMQP brokers requeue a dead connection's messages
themselves.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Container, Iterable, Sequence
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


def _tag(request: Any) -> str | None:
    tag = getattr(getattr(request, "message", None), "delivery_tag", None)
    return tag if isinstance(tag, str) else None


class HeldReturn:
    """Remembers the held deliveries a lost connection dropped; puts them back later."""

    def __init__(self, visibility: float) -> None:
        self.visibility = visibility
        self._dropped: list[tuple[str | None, float]] = []
        self._task_ids: dict[str, str] = {}  # delivery tag -> task id, for the log
        self._old_channel: Any = None

    def remember(
        self,
        forgotten: Sequence[Delivery],
        channel: Any,
        batched: Sequence[tuple[Any, float]] = (),
    ) -> None:
        """At the consumer's stop after a lost connection: ``channel`` is the old one.
        ``batched``: the batched calls it held (worker/batching.py), each request with
        when it was received: held messages the same, as long as their batch waits."""
        held = [(d.request, d.claimed_at) for d in forgotten] + list(batched)
        self._dropped += [(_tag(request), since) for request, since in held]
        self._task_ids.update((_tag(request) or "", request.id) for request, _ in held)
        if held:
            self._old_channel = channel

    def put_back(
        self,
        channel: Any,
        deliver: Callable[[Any], None] | None = None,
        unrecorded: Callable[[Any, str], bool] = lambda qos, tag: False,
    ) -> int:
        """At the consumer's start, connected again, before it consumes: keep or put back
        what may be (through ``channel``, the new one); returns how many.

        With ``deliver`` (it hands a message to the consumer once it consumes), each is
        kept: taken into the new channel without leaving the unacked index
        (``internals.adopt_unacked``) and delivered to the worker again, so it never
        passes through its queue, where a second broker crash could lose it. Without,
        or where kombu lacks what that needs, each is put back in its queue.
        ``unrecorded`` puts a message the broker never recorded unacked back in its queue
        through the given QoS, from the worker's copy (False: the broker had recorded
        it)."""
        dropped, self._dropped = self._dropped, []
        task_ids, self._task_ids = self._task_ids, {}
        old, self._old_channel = self._old_channel, None
        if not dropped:
            return 0
        unrestored = internals.unrestored(old)
        adopt = internals.adopt_unacked(channel) if deliver is not None else None
        restore = internals.restore_by_tag(channel)
        if unrestored is None or restore is None:
            return 0
        tags = returnable(dropped, unrestored, time.monotonic(), self.visibility)
        kept: list[str] = []
        put: list[str] = []
        for tag in tags:
            try:
                if adopt is not None and deliver is not None:
                    message = adopt(tag, time.time())  # kombu scores by the wall clock
                    if message is not None:
                        deliver(message)
                        kept.append(tag)
                    elif unrecorded(getattr(channel, "qos", None), tag):
                        # Never recorded: in no queue, no index; this copy was the only one.
                        put.append(tag)
                    # else no longer unacked: nothing of it is this worker's
                else:
                    restore(tag)
                    put.append(tag)
            except Exception as exc:
                logger.warning(
                    "baton: %d held messages not kept nor put back in their queues (%s); "
                    "the broker's visibility timeout brings them back",
                    len(tags) - len(kept) - len(put),
                    exc,
                )
                break
            # Never again by the old channel (kombu restores what is left there when
            # it is collected): by now the message may be another worker's.
            unrestored.pop(tag, None)
        if kept:
            logger.info(
                "baton: %d held messages kept across the reconnect (the broker could not "
                "take them back when the connection was lost): %s",
                len(kept),
                ", ".join(task_ids.get(tag, "?") for tag in kept),
            )
        if put:
            # Each id is named: a message being delivered again when the broker dies
            # can be lost in kombu's Redis transport (docs/failure.md), and the log
            # then says which ones were on their way.
            logger.info(
                "baton: %d held messages put back in their queues (the broker could not "
                "take them back when the connection was lost): %s",
                len(put),
                ", ".join(task_ids.get(tag, "?") for tag in put),
            )
        return len(kept) + len(put)
