"""Acks sent to a Redis broker without waiting for the reply on the consumer's loop.

kombu's Redis transport acks a delivery tag with a ``MULTI ZREM HDEL EXEC`` it waits
for (``QoS.ack``): one broker round trip per task on the consumer's one thread, whose
CPU bounds how fast a worker drains short tasks (docs/benchmarks.md#issue-36-twelfth:
the wait was the largest part of what a guarded drain paid beyond plain Celery's). Here
the same transaction goes out on a broker connection of its own, and its replies are
read when the loop sees that connection readable: the loop meanwhile hands the pool its
next jobs.

What kombu's ack does besides the round trip happens at once, as before: the tag leaves
the prefetch window (``virtual.QoS.ack``), and kombu marks the message ``ACK``. What
reads "the broker confirmed it" waits for the reply:

* a message whose ack is unanswered carries :data:`UNCONFIRMED_ATTR`; the request's
  ``_baton_unacked`` reads it, and a unique claim decided on the ack
  (``Releasing.after_ack``) is decided once :meth:`AckWriter.when_answered` says so;
* an ack the broker did not confirm (the connection broke, no reply within
  :data:`REPLY_MAX`, an error reply) leaves its message as a failed kombu ack leaves
  it, not acknowledged (its state back to ``RECEIVED``), and is logged as Celery logs
  "Couldn't ack": its copy is the broker's to deliver again, and ``AckFates`` asks
  the broker whether it did run after all.

Before kombu's channel closes (a restart after a lost connection, a shutdown), every
ack sent is answered or given up (:meth:`AckWriter.settle`): kombu's close restores the
messages it still counts as delivered (acked ones among them until its books are
flushed), on another connection, which must not overtake an ack still in flight.

Only the loop's thread writes the connection: an ack made on another thread, or where
the worker has no event loop (gevent, eventlet: Celery's synchronous loop), or after
:meth:`AckWriter.close`, is kombu's own, waited for as before.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from celery_baton.store.wire import Wire

logger = logging.getLogger("celery_baton.worker")

#: Set on a message (kombu's ``Message``) while the broker has not answered its ack.
UNCONFIRMED_ATTR = "_baton_ack_unconfirmed"
#: An ack unanswered this long (seconds) is given up: its message counts as unacked
#: (the broker connection's ``socket_timeout`` when it has one, as kombu's ack).
REPLY_MAX = 30.0
#: How long a settle waits for the replies of the acks in flight (seconds).
SETTLE_MAX = 5.0
#: Replies per ack: MULTI, two QUEUED, EXEC.
_REPLIES = 4
_INSTALLED_ATTR = "_baton_acks_unawaited"
_BROKEN = (RedisConnectionError, RedisTimeoutError, OSError)


def unconfirmed(message: Any) -> bool:
    """Whether ``message``'s ack was sent and not answered yet."""
    return bool(getattr(message, "__dict__", {}).get(UNCONFIRMED_ATTR))


def _redis_qos(channel: Any) -> Any:
    try:
        from kombu.transport.redis import QoS
    except ImportError:  # redis-py absent: not that transport
        return None
    qos = getattr(channel, "qos", None)
    return qos if isinstance(qos, QoS) else None


class AckWriter:
    """A worker's acks to its Redis broker, sent on a connection of their own.

    One per worker; :meth:`install` binds it to each consumer start's task channel and
    event loop."""

    def __init__(self) -> None:
        self._qos: Any = None
        self._kombu_ack: Callable[[Any], Any] | None = None
        self._hub: Any = None
        self._loop_thread: int | None = None
        self._wire: Wire | None = None
        self._fd: int | None = None
        self._keys: tuple[str, str] = ("", "")
        #: Acks sent and not answered, oldest first: (tag, message, sent at).
        self._pending: deque[tuple[Any, Any, float]] = deque()
        self._replies: list[Any] = []  # the replies read so far of the oldest ack
        self._sent = 0  # acks sent on this writer, ever
        self._answered = 0  # of which answered (confirmed or given up), oldest first
        self._waiting: list[tuple[int, Callable[[], None]]] = []
        self._ticker: Any = None
        self._pool: Any = None
        self._down_until = 0.0  # no connecting before (monotonic): it just failed
        self._reply_max = REPLY_MAX
        self.closed = False

    # -- binding -------------------------------------------------------------------------

    def install(self, channel: Any, hub: Any, timer: Any) -> bool:
        """Send ``channel``'s acks through this writer (False: not kombu's Redis
        transport, or no event loop: kombu's ack is kept)."""
        self.settle()  # a previous channel's acks (its connection was lost)
        # A new consumer's loop (the old one's poller was closed): connect again at the
        # next ack, registered on it.
        self._broken("a new consumer")
        qos = _redis_qos(channel)
        if qos is None or hub is None or self.closed:
            return False
        if getattr(qos, _INSTALLED_ATTR, False):
            return True
        pool = getattr(getattr(channel, "client", None), "connection_pool", None)
        if pool is None or not callable(getattr(qos, "ack", None)):
            return False
        prefix = getattr(channel, "global_keyprefix", "") or ""
        self._keys = (prefix + qos.unacked_index_key, prefix + qos.unacked_key)
        self._pool = pool
        self._qos = qos
        self._kombu_ack = qos.ack
        self._hub = hub
        self._loop_thread = threading.get_ident()
        qos.ack = self.ack
        setattr(qos, _INSTALLED_ATTR, True)
        with contextlib.suppress(Exception):
            if self._ticker is not None:
                timer.cancel(self._ticker)
        self._ticker = timer.call_repeatedly(1.0, self._check_overdue, priority=5)
        return True

    # -- acking --------------------------------------------------------------------------

    def ack(self, delivery_tag: Any) -> None:
        """kombu's ``QoS.ack``, its reply not waited for (see the module docstring)."""
        kombu_ack = self._kombu_ack
        assert kombu_ack is not None
        if self.closed or threading.get_ident() != self._loop_thread:
            kombu_ack(delivery_tag)
            return
        wire = self._wire or self._connect()
        if wire is None:
            kombu_ack(delivery_tag)  # raises as kombu's does; Celery logs it
            return
        index, unacked = self._keys
        try:
            wire.send(
                ("MULTI",),
                ("ZREM", index, delivery_tag),
                ("HDEL", unacked, delivery_tag),
                ("EXEC",),
            )
        except _BROKEN:
            self._broken("the connection broke")
            kombu_ack(delivery_tag)  # on kombu's own connection: raises, or it acks
            return
        qos = self._qos
        message = qos._delivered.get(delivery_tag)
        if message is not None:
            message.__dict__[UNCONFIRMED_ATTR] = True
        self._pending.append((delivery_tag, message, time.monotonic()))
        self._sent += 1
        from kombu.transport import virtual

        virtual_ack: Any = virtual.QoS.ack
        virtual_ack(qos, delivery_tag)  # out of the prefetch window, as kombu's ack does

    def when_answered(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once every ack sent so far was answered (at once if none
        waits)."""
        if self._answered >= self._sent:
            callback()
            return
        self._waiting.append((self._sent, callback))

    # -- the connection ------------------------------------------------------------------

    def _connect(self) -> Wire | None:
        if time.monotonic() < self._down_until:
            return None
        pool = self._pool
        try:
            conn = pool.connection_class(**pool.connection_kwargs)
            wire = Wire(conn)
        except _BROKEN as exc:  # the broker is away: kombu's ack says so, for a second
            logger.debug("baton: no connection for acks (%r)", exc)
            self._down_until = time.monotonic() + 1.0
            return None
        except Exception as exc:  # a connection class this module does not know
            logger.info("baton: acks are kombu's own, waited for (%r)", exc)
            self.closed = True
            return None
        self._reply_max = float(getattr(conn, "socket_timeout", None) or REPLY_MAX)
        self._wire = wire
        self._fd = wire.fileno()
        self._hub.add_reader(self._fd, self._on_readable)
        return wire

    def _on_readable(self, *args: Any) -> None:
        wire = self._wire
        if wire is None:
            return
        try:
            self._take(wire.read_ready())
        except _BROKEN as exc:
            self._broken(f"{exc}")

    def _take(self, replies: list[Any]) -> None:
        for reply in replies:
            self._replies.append(reply)
            if len(self._replies) < _REPLIES:
                continue
            exec_reply = self._replies[-1]
            self._replies = []
            tag, message, _ = self._pending.popleft()
            if isinstance(exec_reply, (ResponseError, type(None))):
                self._given_up(tag, message, f"the broker answered {exec_reply!r}")
            elif message is not None:
                message.__dict__.pop(UNCONFIRMED_ATTR, None)
            self._answered += 1
        self._run_waiting()

    def _given_up(self, tag: Any, message: Any, why: str) -> None:
        """An ack the broker did not confirm: its message is not acknowledged, as a
        failed kombu ack leaves it (Celery logged its own "Couldn't ack" so)."""
        # Celery's words for a failed ack: the same failure, found later.
        logger.error("baton: Couldn't ack %s, reason: %s; the broker delivers it again", tag, why)
        if message is not None:
            message.__dict__.pop(UNCONFIRMED_ATTR, None)
            message._state = "RECEIVED"

    def _run_waiting(self) -> None:
        if not self._waiting:
            return
        due = [callback for sent, callback in self._waiting if sent <= self._answered]
        if not due:
            return
        self._waiting = [(sent, cb) for sent, cb in self._waiting if sent > self._answered]
        for callback in due:
            try:
                callback()
            except Exception:  # the loop would only log it: never keep a key silently
                logger.exception("baton: a call waiting for acks failed")

    def _check_overdue(self) -> None:
        if self._pending and time.monotonic() - self._pending[0][2] > self._reply_max:
            self._broken(f"no reply in {self._reply_max:g}s")

    def _broken(self, why: str) -> None:
        """Drop the connection; every ack in flight is given up (it may have run: the
        claims it decides are then kept until ``AckFates`` asked the broker)."""
        wire, self._wire = self._wire, None
        if wire is not None:
            if self._fd is not None and self._hub is not None:
                with contextlib.suppress(Exception):  # gone already if the loop was reset
                    self._hub.remove_reader(self._fd)
            self._fd = None
            with contextlib.suppress(Exception):
                wire.close()
        self._replies = []
        pending, self._pending = self._pending, deque()
        for tag, message, _ in pending:
            self._given_up(tag, message, why)
            self._answered += 1
        self._run_waiting()

    def settle(self, timeout: float = SETTLE_MAX) -> None:
        """Wait (up to ``timeout``) for every ack in flight to be answered; the ones
        not answered by then are given up."""
        wire = self._wire
        if wire is None or not self._pending:
            return
        deadline = time.monotonic() + timeout
        try:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RedisTimeoutError(f"no reply in {timeout:g}s")
                wire._sock.settimeout(left)
                self._take([wire.read()])
        except _BROKEN as exc:
            self._broken(f"{exc}")

    def close(self) -> None:
        """Settle, then ack the kombu way from now on (a shutdown: the loop stopped)."""
        self.settle()
        self.closed = True
        self._broken("closed")
