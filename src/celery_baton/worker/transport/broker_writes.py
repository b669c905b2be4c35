"""kombu's Redis bookkeeping writes, sent without waiting for the reply on the loop.

For every message it delivers, kombu's Redis transport writes twice to the broker and
waits for each reply on the consumer's one thread: the record that the message is
unacknowledged (``QoS.append``: ``MULTI ZADD HSET EXEC``) and, once it ran, its ack
(``QoS.ack``: ``MULTI ZREM HDEL EXEC``), each built as a redis-py pipeline (a copy of
the client's table of reply callbacks per pipeline). The consumer's CPU bounds how fast
a worker drains short tasks, and these two were the largest part of it beyond the
tasks' own work (docs/benchmarks.md#issue-36-twelfth). Here the same two transactions
go out on a broker connection of their own, packed directly, and their replies are
read when the loop sees that connection readable: the loop meanwhile hands the pool
its next jobs. Redis runs one connection's commands in the order it reads them, so a
message's record always lands before its ack.

What kombu does besides the round trip happens at once, as before: its books of
delivered messages (the prefetch window), and the message's ``ACK`` state. What reads
"the broker confirmed it" waits for the reply:

* a message whose ack is unanswered carries :data:`UNCONFIRMED_ATTR`; the request's
  ``_baton_unacked`` reads it, and a unique claim decided on the ack
  (``Releasing.after_ack``) is decided once :meth:`BrokerWrites.when_answered` says so;
* an ack the broker did not confirm (the connection broke, no reply within the broker
  connection's ``socket_timeout``, an error reply) leaves its message as a failed
  kombu ack leaves it, not acknowledged (its state back to ``RECEIVED``), and is
  logged with Celery's words, "Couldn't ack": its copy is the broker's to deliver
  again, and ``AckFates`` asks the broker whether the ack ran after all;
* a record the broker did not confirm is logged: the message runs (kombu's failed
  record raised before the run, and the message was lost), but a worker that dies
  before its ack leaves nothing for the broker to deliver again. Its ack goes out on
  the next connection, and may be run before the record, still in the old one's
  buffer, that a paused broker reads when it goes on: the message would come back
  after it ran. So that ack is sent once more once it was answered: by then the broker
  has turned its loop past the one in which it read what the old connection held.

Every other write of kombu's that reads or moves these books (a reject, a restore of a
delivered message, the restore of all of them when its channel closes) and celery-
baton's own grouped acks must not overtake a write in flight on this connection: each
first waits for the replies (:meth:`BrokerWrites.settle`; the consumer's ``stop`` does
before kombu's channel closes).

Only the loop's thread writes the connection: a record or an ack made on another
thread is kombu's own, once the loop's thread has read the replies of the writes in
flight (Celery hands its own acks to the loop). Without an event loop (gevent,
eventlet: Celery's synchronous loop), on another transport, and after a shutdown
(:meth:`BrokerWrites.close`), the writes are kombu's own, waited for as before.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from kombu.transport import virtual
from kombu.utils.json import dumps
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from celery_baton.wire import Wire
from celery_baton.worker.transport.broker import kombu_redis_qos

logger = logging.getLogger("celery_baton.worker")

#: Set on a message (kombu's ``Message``) while the broker has not answered its ack.
UNCONFIRMED_ATTR = "_baton_ack_unconfirmed"
#: A write unanswered this long (seconds) is given up, when the broker connection has
#: no ``socket_timeout`` of its own (kombu's writes then wait that long).
REPLY_MAX = 30.0
#: How long a settle waits for the replies of the writes in flight (seconds).
SETTLE_MAX = 5.0
#: Replies per write: MULTI, two QUEUED, EXEC.
_REPLIES = 4
_INSTALLED_ATTR = "_baton_broker_writes"
_BROKEN = (RedisConnectionError, RedisTimeoutError, OSError)
_RECORD, _ACK, _ACK_AGAIN = "record", "ack", "ack again"


def unconfirmed(message: Any) -> bool:
    """Whether ``message``'s ack was sent and not answered yet."""
    return bool(getattr(message, "__dict__", {}).get(UNCONFIRMED_ATTR))


def writes_of(qos: Any) -> BrokerWrites | None:
    """The writes installed on kombu's ``qos`` (None: kombu's own)."""
    writes = getattr(qos, _INSTALLED_ATTR, None)
    return writes if isinstance(writes, BrokerWrites) else None


class BrokerWrites:
    """A worker's records and acks on its Redis broker, on a connection of their own.

    One per worker; :meth:`install` binds it to each consumer start's task channel and
    event loop."""

    def __init__(self) -> None:
        self._hub: Any = None
        self._pool: Any = None
        self._loop_thread: int | None = None
        self._wire: Wire | None = None
        self._fd: int | None = None
        self._keys: tuple[str, str] = ("", "")
        #: Writes sent and not answered, oldest first: (kind, tag, message, sent at).
        self._pending: deque[tuple[str, Any, Any, float]] = deque()
        self._replies: list[Any] = []  # the replies read so far of the oldest write
        self._sent = 0  # writes sent, ever
        self._answered = 0  # of which answered (confirmed or given up), oldest first
        self._waiting: list[tuple[int, Callable[[], None]]] = []
        self._ticker: Any = None
        self._down_until = 0.0  # no connecting before (monotonic): it just failed
        self._reply_max = REPLY_MAX
        #: Tags whose record was given up: their ack is sent again once answered.
        self._unsure_records: set[Any] = set()
        self.closed = False

    # -- binding -------------------------------------------------------------------------

    def install(self, channel: Any, hub: Any, timer: Any) -> bool:
        """Take over ``channel``'s records and acks (False: not kombu's Redis transport,
        or no event loop: kombu's writes are kept)."""
        self.settle()  # a previous channel's (its connection was lost)
        # A new consumer's loop (the old one's poller was closed): connect again at the
        # next write, registered on it.
        self._broken("a new consumer")
        qos = kombu_redis_qos(channel, its_own_writes=True)
        if qos is None or hub is None or self.closed:
            return False
        if writes_of(qos) is not None:
            return True
        pool = getattr(getattr(channel, "client", None), "connection_pool", None)
        if pool is None:
            return False
        prefix = getattr(channel, "global_keyprefix", "") or ""
        self._keys = (prefix + qos.unacked_index_key, prefix + qos.unacked_key)
        self._pool = pool
        self._hub = hub
        self._loop_thread = threading.get_ident()
        # Each channel's own QoS and kombu's writes on it: a run of an earlier consumer
        # (before a lost connection) is acked on the channel it came from.
        kombu_append, kombu_ack = qos.append, qos.ack
        qos.append = lambda message, tag: self.append(qos, kombu_append, message, tag)
        qos.ack = lambda tag: self.ack(qos, kombu_ack, tag)
        qos.reject = self._settled(qos.reject)
        qos.restore_by_tag = self._settled(qos.restore_by_tag)
        setattr(qos, _INSTALLED_ATTR, self)
        if self._ticker is not None:
            with contextlib.suppress(Exception):
                self._ticker.cancel()
        self._ticker = timer.call_repeatedly(1.0, self._check_overdue, priority=5)
        return True

    def _settled(self, write: Callable[..., Any]) -> Callable[..., Any]:
        """``write`` (a kombu write on its own connection), once the writes in flight
        here were answered: it must not overtake them."""

        def after_the_writes_in_flight(*args: Any, **kwargs: Any) -> Any:
            self._wait_for_the_writes_in_flight()
            return write(*args, **kwargs)

        return after_the_writes_in_flight

    # -- the writes ----------------------------------------------------------------------

    def append(
        self, qos: Any, kombu_append: Callable[..., Any], message: Any, delivery_tag: Any
    ) -> None:
        """kombu's ``QoS.append`` on ``qos``, its reply not waited for (see the module
        docstring)."""
        if not self._here():
            kombu_append(message, delivery_tag)
            return
        delivery = message.delivery_info
        raw = dumps([message._raw, delivery["exchange"], delivery["routing_key"]])  # type: ignore[no-untyped-call]
        index, unacked = self._keys
        record = (
            ("MULTI",),
            ("ZADD", index, repr(time.time()), delivery_tag),
            ("HSET", unacked, delivery_tag, raw),
            ("EXEC",),
        )
        if not self._send(_RECORD, delivery_tag, None, record):
            kombu_append(message, delivery_tag)  # waited for, as kombu's
            return
        virtual_append: Any = virtual.QoS.append
        virtual_append(qos, message, delivery_tag)

    def ack(self, qos: Any, kombu_ack: Callable[..., Any], delivery_tag: Any) -> None:
        """kombu's ``QoS.ack`` on ``qos``, its reply not waited for (see the module
        docstring)."""
        if not self._here():
            kombu_ack(delivery_tag)
            return
        message = qos._delivered.get(delivery_tag)
        if not self._send(_ACK, delivery_tag, message, self._ack_commands(delivery_tag)):
            kombu_ack(delivery_tag)  # raises as kombu's does; Celery logs it
            return
        if message is not None:
            message.__dict__[UNCONFIRMED_ATTR] = True
        virtual_ack: Any = virtual.QoS.ack
        virtual_ack(qos, delivery_tag)  # out of the prefetch window, as kombu's ack does

    def _ack_commands(self, delivery_tag: Any) -> tuple[Any, ...]:
        index, unacked = self._keys
        return (
            ("MULTI",),
            ("ZREM", index, delivery_tag),
            ("HDEL", unacked, delivery_tag),
            ("EXEC",),
        )

    def _here(self) -> bool:
        """Whether a write goes through this connection now (else kombu's own)."""
        if self.closed:
            return False
        if threading.get_ident() == self._loop_thread:
            return True
        # Another thread: kombu's own write on its connection could overtake one in
        # flight here (the threads pool's own acks go through Celery's hub.call_soon).
        self._wait_for_the_writes_in_flight()
        return False

    def _wait_for_the_writes_in_flight(self) -> None:
        """Before a kombu write on its own connection: every write in flight here
        answered. The loop's thread reads the replies itself; another thread cannot read
        this connection, so it waits (bounded) for the loop's thread to have read them."""
        if threading.get_ident() == self._loop_thread:
            if self._pending:
                self.settle()
            return
        deadline = time.monotonic() + SETTLE_MAX
        while self._answered < self._sent and time.monotonic() < deadline:
            time.sleep(0.001)

    def _send(self, kind: str, tag: Any, message: Any, commands: tuple[Any, ...]) -> bool:
        wire = self._wire or self._connect()
        if wire is None:
            return False
        try:
            wire.send(*commands)
        except _BROKEN as exc:
            self._broken(f"{exc}")
            return False
        self._pending.append((kind, tag, message, time.monotonic()))
        self._sent += 1
        return True

    def when_answered(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once every write sent so far was answered (at once if none
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
        except _BROKEN as exc:  # the broker is away: kombu's write says so, for a second
            logger.debug("baton: no broker connection for its writes (%r)", exc)
            self._down_until = time.monotonic() + 1.0
            return None
        except Exception as exc:  # a connection class this module does not know
            logger.info("baton: kombu's broker writes kept, waited for (%r)", exc)
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
            kind, tag, message, _ = self._pending.popleft()
            if isinstance(exec_reply, ResponseError | type(None)):
                self._given_up(kind, tag, message, f"the broker answered {exec_reply!r}")
            elif kind == _ACK:
                if message is not None:
                    message.__dict__.pop(UNCONFIRMED_ATTR, None)
                if tag in self._unsure_records:
                    self._unsure_records.discard(tag)
                    self._send(_ACK_AGAIN, tag, None, self._ack_commands(tag))
            self._answered += 1
        self._run_waiting()

    def _given_up(self, kind: str, tag: Any, message: Any, why: str) -> None:
        if kind == _ACK_AGAIN:
            logger.warning("baton: acking %s a second time failed (%s)", tag, why)
            return
        if kind == _RECORD:
            self._unsure_records.add(tag)
            logger.warning(
                "baton: message %s was not recorded unacked (%s): it runs, but were this "
                "worker to die before its ack, the broker could not deliver it again",
                tag,
                why,
            )
            return
        # Celery's words for a failed ack: the same failure, found later. The message is
        # left as a failed kombu ack leaves it: not acknowledged.
        logger.error("baton: Couldn't ack %s, reason: %s; the broker delivers it again", tag, why)
        if message is not None:
            message.__dict__.pop(UNCONFIRMED_ATTR, None)
            message._state = "RECEIVED"

    def _run_waiting(self) -> None:
        if not self._waiting:
            return
        answered = self._answered
        due = [callback for sent, callback in self._waiting if sent <= answered]
        if not due:
            return
        self._waiting = [(sent, callback) for sent, callback in self._waiting if sent > answered]
        for callback in due:
            try:
                callback()
            except Exception:  # the loop would only log it: never keep a key silently
                logger.exception("baton: a call waiting for the broker's replies failed")

    def _check_overdue(self) -> None:
        if self._pending and time.monotonic() - self._pending[0][3] > self._reply_max:
            self._broken(f"no reply in {self._reply_max:g}s")

    def _broken(self, why: str) -> None:
        """Drop the connection; every write in flight is given up (it may have run: an
        ack's claim is then kept until ``AckFates`` asked the broker)."""
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
        for kind, tag, message, _ in pending:
            self._given_up(kind, tag, message, why)
            self._answered += 1
        self._run_waiting()

    def settle(self, timeout: float = SETTLE_MAX) -> None:
        """Wait (up to ``timeout``) for every write in flight to be answered; the ones
        not answered by then are given up. The loop's thread only."""
        wire = self._wire
        if wire is None or not self._pending:
            return
        deadline = time.monotonic() + timeout
        try:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RedisTimeoutError(f"no reply in {timeout:g}s")
                wire.conn._sock.settimeout(min(left, self._reply_max))
                self._take([wire.read()])
        except _BROKEN as exc:
            self._broken(f"{exc}")

    def close(self) -> None:
        """Settle, then leave the writes to kombu from now on (a shutdown)."""
        self.settle()
        self.closed = True
        self._broken("closed")
