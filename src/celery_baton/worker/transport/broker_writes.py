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
  record raised before the run, and the message was lost), and the record is sent
  again every second while the message is still delivered here (not acked nor given
  back), until the broker takes it; meanwhile a worker that dies before its ack leaves
  nothing for the broker to deliver again. Its ack goes out on
  the next connection, and may be run before the record, still in the old one's
  buffer, that a paused broker reads when it goes on: the message would come back
  after it ran. So that ack is sent once more once it was answered: by then the broker
  has turned its loop past the one in which it read what the old connection held.
  A message given back instead of run (a held one handed back, or restored when its
  channel closes) is put back in its queue from the record kept here when the broker
  has none: kombu's restore reads the broker's record alone, and found nothing to put
  back (tests/transport/test_unrecorded_held.py).

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

from celery_baton import internals
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
        #: Writes sent and not answered, oldest first: (kind, tag, message, sent at); a
        #: record carries the record itself in place of the message.
        self._pending: deque[tuple[str, Any, Any, float]] = deque()
        self._replies: list[Any] = []  # the replies read so far of the oldest write
        self._sent = 0  # writes sent, ever
        self._answered = 0  # of which answered (confirmed or given up), oldest first
        self._waiting: list[tuple[int, Callable[[], None]]] = []
        self._ticker: Any = None
        self._down_until = 0.0  # no connecting before (monotonic): it just failed
        self._reply_max = REPLY_MAX
        #: Tags whose record was given up, with the record: their ack is sent again
        #: once answered; given back, the message is put back from it.
        self._unrecorded: dict[Any, str] = {}
        #: Of those, the ones to record again, with their channel's delivered messages
        #: (kombu's ``QoS._delivered``): sent once a connection answers, while the
        #: message is still delivered there (running or held, not acked nor given back).
        self._to_record: dict[Any, Any] = {}
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
        index_key, unacked_key = internals.prefixed_keys(
            channel, [qos.unacked_index_key, qos.unacked_key]
        )
        self._keys = (index_key, unacked_key)
        self._pool = pool
        self._hub = hub
        self._loop_thread = threading.get_ident()
        # Each channel's own QoS and kombu's writes on it: a run of an earlier consumer
        # (before a lost connection) is acked on the channel it came from.
        kombu_append, kombu_ack = qos.append, qos.ack
        delivered = internals.unrestored(channel)
        qos.append = lambda message, tag: self.append(qos, kombu_append, message, tag, delivered)
        qos.ack = lambda tag: self.ack(qos, kombu_ack, tag)
        qos.reject = self._rejecting(self._settled(qos.reject))
        qos.restore_by_tag = self._restoring(qos, qos.restore_by_tag)
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

    def _rejecting(self, kombu_reject: Callable[..., Any]) -> Callable[..., Any]:
        """kombu's ``QoS.reject``: the message is no longer this worker's, its record is
        not sent again (it would have the broker deliver a dropped message again)."""

        def reject(delivery_tag: Any, requeue: bool = False) -> Any:
            self._to_record.pop(delivery_tag, None)
            return kombu_reject(delivery_tag, requeue=requeue)

        return reject

    def _restoring(self, qos: Any, kombu_restore: Callable[..., Any]) -> Callable[..., Any]:
        """kombu's ``QoS.restore_by_tag`` (a requeue, a hand-back, a closing channel's
        restore), once the writes in flight were answered, and from the record kept
        here for a message whose record the broker did not confirm."""

        def restore_by_tag(tag: Any, client: Any = None, leftmost: bool = False) -> Any:
            self._wait_for_the_writes_in_flight()
            if not self.put_back_unrecorded(qos, tag, leftmost):
                return kombu_restore(tag, client=client, leftmost=leftmost)
            return None

        return restore_by_tag

    def put_back_unrecorded(self, qos: Any, tag: Any, leftmost: bool = True) -> bool:
        """Put ``tag``'s message back in its queue through ``qos`` from the record kept
        here, if the broker did not confirm that record (False: it did, or nothing of it
        is known here). The record is forgotten once the message is back; a broker that
        fails meanwhile raises, and the record is kept for a later try."""
        record = self._unrecorded.get(tag)
        restore_with = internals.restore_with_record(qos) if record is not None else None
        if record is None or restore_with is None:
            return False
        restore_with(tag, record, leftmost)
        del self._unrecorded[tag]
        self._to_record.pop(tag, None)
        logger.info(
            "baton: message %s put back in its queue from the worker's copy (the broker "
            "had not recorded it)",
            tag,
        )
        return True

    # -- the writes ----------------------------------------------------------------------

    def append(
        self,
        qos: Any,
        kombu_append: Callable[..., Any],
        message: Any,
        delivery_tag: Any,
        delivered: Any = None,
    ) -> None:
        """kombu's ``QoS.append`` on ``qos``, its reply not waited for (see the module
        docstring). ``delivered``: the channel's delivered messages (kombu's
        ``QoS._delivered``), where a record given up is recorded again from."""
        if not self._here():
            kombu_append(message, delivery_tag)
            return
        delivery = message.delivery_info
        raw = dumps([message._raw, delivery["exchange"], delivery["routing_key"]])  # type: ignore[no-untyped-call]
        if not self._send(_RECORD, delivery_tag, (raw, delivered), self._record(delivery_tag, raw)):
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
        # Acked: its record is not sent again, even while kombu still lists the message
        # as delivered (its acked tags leave ``QoS._delivered`` only at its next flush): a
        # record sent after the ack would have the broker deliver it again.
        self._to_record.pop(delivery_tag, None)
        if not self._send(_ACK, delivery_tag, message, self._ack_commands(delivery_tag)):
            kombu_ack(delivery_tag)  # raises as kombu's does; Celery logs it
            return
        if message is not None:
            message.__dict__[UNCONFIRMED_ATTR] = True
        virtual_ack: Any = virtual.QoS.ack
        virtual_ack(qos, delivery_tag)  # out of the prefetch window, as kombu's ack does

    def _record(self, delivery_tag: Any, raw: str) -> tuple[Any, ...]:
        index, unacked = self._keys
        return (
            ("MULTI",),
            ("ZADD", index, repr(time.time()), delivery_tag),
            ("HSET", unacked, delivery_tag, raw),
            ("EXEC",),
        )

    def _record_again(self) -> None:
        """Send again the records given up of messages still delivered here: once one
        lands, a worker that dies before the message's ack leaves it for the broker to
        deliver again (it was this worker's alone). On the loop's thread, every second;
        a message acked or given back meanwhile needs none (its ack or its put-back is
        what the broker must know)."""
        for tag, delivered in list(self._to_record.items()):
            record = self._unrecorded.get(tag)
            if record is None or delivered is None or tag not in delivered:
                del self._to_record[tag]
                continue
            if not self._send(_RECORD, tag, (record, delivered), self._record(tag, record)):
                return  # no connection yet: at the next tick
            del self._to_record[tag]

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
        self._take_from(Wire.read_ready)

    def _take_from(self, read: Callable[[Wire], list[Any]]) -> None:
        """Take the replies ``read`` takes from the wire."""
        wire = self._wire
        if wire is None:
            return
        try:
            self._take(read(wire))
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
                if tag in self._unrecorded:
                    del self._unrecorded[tag]
                    self._send(_ACK_AGAIN, tag, None, self._ack_commands(tag))
            self._answered += 1
        self._run_waiting()

    def _given_up(self, kind: str, tag: Any, message: Any, why: str) -> None:
        if kind == _ACK_AGAIN:
            logger.warning("baton: acking %s a second time failed (%s)", tag, why)
            return
        if kind == _RECORD:
            record, delivered = message  # (see append)
            again = tag in self._unrecorded
            self._unrecorded[tag] = record
            self._to_record[tag] = delivered
            if again:  # refused once more: it is tried every second, logged once
                logger.debug("baton: message %s was not recorded again (%s)", tag, why)
                return
            logger.warning(
                "baton: message %s was not recorded unacked (%s): it runs, or is put back "
                "from this worker's copy; its record is sent again until the broker takes "
                "it (until then, were this worker to die before its ack, the broker could "
                "not deliver it again)",
                tag,
                why,
            )
            return
        # Celery's words for a failed ack: the same failure, found later. The message is
        # left as a failed kombu ack leaves it: not acknowledged; a record of it given up
        # just before (on the same connection) is not sent again: the message ran.
        self._to_record.pop(tag, None)
        headers = getattr(message, "headers", None) or {}
        logger.error(
            "baton: Couldn't ack %s (%s[%s]), reason: %s; the broker delivers it again",
            tag,
            headers.get("task"),
            headers.get("id"),
            why,
        )
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
        if self._overdue():
            # The loop may not have read for a while (a body running on solo's loop, a
            # loop that stood still on a loaded machine): what was answered meanwhile is
            # not overdue, and giving it up would say an ack failed that landed.
            self._take_from(Wire.read_arrived)
            if self._overdue():
                self._broken(f"no reply in {self._reply_max:g}s")
        if self._to_record and not self.closed:
            self._record_again()

    def _overdue(self) -> bool:
        return bool(self._pending) and time.monotonic() - self._pending[0][3] > self._reply_max

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
