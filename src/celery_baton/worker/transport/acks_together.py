"""Acking the held messages of a batch together: one broker round trip, not one per call.

kombu's Redis transport acks a delivery tag with a ``MULTI ZREM HDEL EXEC`` of its own
(``QoS.ack``): when a batch of 100 calls has run, its holders' 100 acks went back to
back on the consumer's loop, which meanwhile neither read the pool's results nor wrote
it new jobs (docs/benchmarks.md#batching, bound 2). Here the tags of the messages
received on one channel leave kombu's unacked index and hash in one transaction, and
each message and request is then left as its own ack would leave it (kombu's delivered
map, the message's state, ``Request.acknowledged``).

What falls back to Celery's own ack, one message at a time (which also logs and
recovers as Celery does): another transport (AMQP acks are frames sent without waiting
for a reply), a message whose ack Celery chained more to (after a broker reconnection it
restores the prefetch count at the next ack), a lone message, and every message of a
transaction that failed (the broker down: each then fails and is logged as before; the
calls ran and are marked done, so a copy that comes back is acked without running).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from celery_baton.worker.transport.broker import kombu_redis_qos
from celery_baton.worker.transport.broker_writes import writes_of

logger = logging.getLogger("celery_baton.worker")


def _plain_ack(request: Any) -> bool:
    """Whether the request's ack is Celery's plain one: nothing chained to its promise
    (vine's ``_svpending``/``_lvpending``; unknown shapes are taken as chained)."""
    on_ack = getattr(request, "_on_ack", None)
    if on_ack is None or not hasattr(on_ack, "_svpending"):
        return False
    return on_ack._svpending is None and not getattr(on_ack, "_lvpending", None)


def acknowledge_together(requests: Sequence[Any]) -> None:
    """Ack every request of ``requests`` not acked yet (see the module docstring)."""
    groups: dict[int, tuple[Any, list[Any]]] = {}
    for request in requests:
        if request.acknowledged:
            continue
        message: Any = getattr(request, "message", None)
        channel = getattr(message, "channel", None)
        qos = kombu_redis_qos(channel)
        if qos is None or message.acknowledged or not _plain_ack(request):
            request.acknowledge()
            continue
        groups.setdefault(id(channel), (qos, []))[1].append(request)
    for qos, group in groups.values():
        if len(group) == 1:
            group[0].acknowledge()
            continue
        writes = writes_of(qos)
        if writes is not None:
            writes.settle()  # its records of these messages land first
        try:
            tags = [request.message.delivery_tag for request in group]
            with qos.pipe_or_acquire() as pipe:
                # kombu's _remove_from_indices, for every tag in one ZREM and one HDEL.
                pipe.zrem(qos.unacked_index_key, *tags).hdel(qos.unacked_key, *tags)
                pipe.execute()
        except Exception as exc:  # the transport's errors: each acked (and logged) alone
            logger.warning(
                "baton: acking %d held messages together failed (%r); acking each alone",
                len(group),
                exc,
            )
            for request in group:
                request.acknowledge()
            continue
        from kombu.transport import virtual

        virtual_ack: Any = virtual.QoS.ack
        for request in group:
            message = request.message
            # What kombu's ack does besides the broker's round trip: the tag leaves the
            # channel's delivered map (the prefetch window), the message is ACK.
            virtual_ack(qos, message.delivery_tag)
            message._state = "ACK"
            request.acknowledged = True
