"""A worker must outlive its broker's crash: kombu's Redis channel finishes closing.

kombu's Redis transport (5.x) reads the BRPOP a channel has pending before it closes
it. When the broker is gone, that read raises before the channel is marked closed, and
Celery's handling of the lost connection (``Consumer.on_connection_error_after_connected``)
swallows the error, detaches the transport from the connection (``collect``) and closes
the connection again: the channel's second close now restores its unacked messages
through a transport whose client is None, raises ``AttributeError: 'NoneType' object
has no attribute 'hostname'``, and the worker exits with "Unrecoverable error". Plain
Celery hits it whenever the broker dies while the worker polls with an unacked message
in hand (one acks_late task running); a request held by celery-baton is exactly that
(waiting costs no prefetch slot, so the worker keeps polling), so nearly every broker
restart killed a worker using it (42 times in a 30-minute soak).

The fix here: when the first close fails before the channel is marked closed, close it
again at once, while the transport is still attached. That is the path kombu takes when
no read is pending: the unacked messages are restored if the broker answers, and
otherwise stay in its unacked index, from which kombu's visibility timeout restores them
(as for a worker that was killed). The original error is raised as before, so Celery
goes on to reconnect. Installed once per worker process, for kombu's Redis transport
only; nothing else changes.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from celery_baton import internals

logger = logging.getLogger("celery_baton.worker")

_MARK = "_baton_finishes_close"


def finish_interrupted_closes() -> None:
    """Make kombu's Redis channels finish a close that a dead broker interrupted (once
    per process; nothing when kombu's Redis channel is not shaped as described above)."""
    try:
        from kombu.transport import redis as kombu_redis
    except ImportError:  # redis-py missing: no Redis transport in this worker
        return
    channel_class = kombu_redis.Channel
    close = internals.redis_channel_close(channel_class)
    if close is None or hasattr(close, _MARK):
        return
    setattr(channel_class, "close", _finishing(close))  # noqa: B010 (a method of kombu's)


def _finishing(close: Callable[[Any], None]) -> Callable[[Any], None]:
    @functools.wraps(close)
    def finishing_close(channel: Any) -> None:
        try:
            close(channel)
        except Exception:
            if getattr(channel, "closed", True):
                raise
            # Interrupted before it was marked closed (the pending read failed): finish
            # now, while the transport is attached. Restoring needs the broker; when it
            # is down the messages come back by the visibility timeout instead.
            try:
                close(channel)
            except Exception as again:
                logger.info(
                    "baton: the broker is gone (%s): unacknowledged messages come back "
                    "after its visibility timeout",
                    again,
                )
            raise

    setattr(finishing_close, _MARK, True)
    return finishing_close
