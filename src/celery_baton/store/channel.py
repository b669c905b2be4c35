"""Script calls answered through callbacks, so a worker's event loop never waits on the
store.

``BlockingChannel`` answers at once (for pools without an event loop: solo, threads).
``PipelinedChannel`` queues each call and returns; queued calls are written together
just before the loop polls, the loop calls the channel back when the socket is
readable, and replies are matched to calls in order (Redis answers a connection's
commands in the order it received them). One write is in flight at a time: calls made
while it is unanswered wait for its replies and then go out together; an urgent call (a
gate ask on a free pool process) goes out at once, taking the queued ones along. Under load many
calls share a write and a round trip (fewer system calls in the worker and in the
store), and the loop keeps receiving messages meanwhile; when idle, a call is written
at the next loop turn.

Every call gets exactly one answer: the reply, or an exception (``StoreUnavailable``
when the connection broke or a reply took longer than the socket timeout).

Only the loop's thread writes the connection and reads its replies: were a call written
from another thread (Celery's threads pool ends a run on its own threads), two writes
could interleave with the queue of pending calls, and replies would answer the wrong
calls. A call made on another thread is queued and handed to the loop (a byte on a pipe
it reads), which sends it at once.

Nothing here waits for the store on the loop. Connecting (TCP, TLS, AUTH, client name,
loading the scripts) is a conversation with the store, so it runs on a thread of its
own while the calls made meanwhile wait in order; a pipe tells the loop when it is
done. After the connection broke, calls are answered ``StoreUnavailable`` at once for
a back-off that doubles (up to ``BACKOFF_MAX``) while the store stays away, instead of
each of them finding out the slow way.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from redis.exceptions import NoScriptError, ResponseError

from celery_baton.store.connection import STORE_ERRORS, Store
from celery_baton.store.scripts import STORE_REPLY_ERRORS, script_sha, script_source
from celery_baton.wire import Wire, pooled_connection

logger = logging.getLogger("celery_baton.store")

Answer = Callable[[Any], None]  # called with the reply, or with an exception
BACKOFF_START = 0.25  # seconds without connecting after the connection broke
# At most this long between two tries to connect: the held requests' probe (a PING a
# second) goes through this channel, so the back-off bounds how late the worker sees
# the store back (with 10 s, its first run came 3.3-6.7 s after a 5 s outage ended;
# with 2 s, 0.9-1.5 s), for the price of one connection attempt per 2 s while it is down.
BACKOFF_MAX = 2.0


def _ignore(reply: Any) -> None:
    """The answer to a command sent for its effect only (SCRIPT LOAD)."""


class BlockingChannel:
    """Calls the store and answers before returning."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def call(
        self,
        name: str,
        keys: Sequence[str],
        args: Sequence[Any],
        answer: Answer,
        *,
        urgent: bool = False,
    ) -> None:
        # ``urgent`` means nothing here: every call is answered before it returns.
        try:
            reply = self.store.scripts.call(name, keys, args)
        except STORE_ERRORS as exc:
            reply = self.store.unavailable(exc)
        except ResponseError as exc:
            reply = exc
        answer(reply)

    def close(self) -> None:
        pass


class PipelinedChannel:
    """Script calls on one connection, replies read when the event loop says so.

    ``hub`` is kombu's event loop (``add_reader``/``remove_reader``); ``timer`` has
    ``call_repeatedly`` and checks that no reply is overdue.
    """

    def __init__(self, store: Store, hub: Any, timer: Any, *, timeout: float) -> None:
        self.store = store
        self.timeout = timeout
        self._wire: Wire | None = None
        self._fd: int | None = None
        self._generation = 0  # of the store's master when the wire connected (Sentinel)
        # (answer, name, keys, args, sent at): one per call not yet answered, in order.
        self._pending: deque[tuple[Answer, str, Sequence[str], Sequence[Any], float]] = deque()
        self._out: list[tuple[Any, ...]] = []  # calls not written yet (see _write)
        self._from_threads: deque[Callable[[], None]] = deque()  # calls made off the loop
        self._urgent = False  # a queued call must not wait for earlier replies (_write)
        self._connecting: threading.Thread | None = None
        self._connected: Wire | BaseException | None = None  # the connector's result
        self._down_until = 0.0  # no connecting before this (monotonic): it just broke
        self._connected_at = 0.0  # when the wire connected (monotonic)
        self._backoff = BACKOFF_START
        self._notify_r, self._notify_w = os.pipe()  # the connector wakes the loop
        os.set_blocking(self._notify_r, False)
        os.set_blocking(self._notify_w, False)
        self._attach(hub, timer)

    def _attach(self, hub: Any, timer: Any) -> None:
        """Run on ``hub``: write before each poll, and check for overdue replies."""
        self.hub = hub
        self._ticker = timer.call_repeatedly(max(0.05, self.timeout / 4), self._check_overdue)
        self._loop_thread = threading.get_ident()
        hub.on_tick.add(self._write)
        hub.add_reader(self._notify_r, self._on_notified)

    def rebind(self, hub: Any, timer: Any) -> None:
        """After the consumer restarted (a lost broker connection): Celery reset the
        event loop, which dropped this channel's socket from the poller and may have
        cancelled its overdue check. Start over on a new connection; calls still
        waiting for a reply are answered with StoreUnavailable (releases are retried
        in the background, and the held requests were given back already)."""
        self._broken(ConnectionError("the worker's event loop was reset"), backoff=False)
        with contextlib.suppress(Exception):  # the timer may have dropped it already
            self._ticker.cancel()
        with contextlib.suppress(Exception):  # gone already if the loop was reset
            self.hub.remove_reader(self._notify_r)
        self._attach(hub, timer)

    def call(
        self,
        name: str,
        keys: Sequence[str],
        args: Sequence[Any],
        answer: Answer,
        *,
        urgent: bool = False,
    ) -> None:
        """``urgent``: a pool slot waits for the answer, so the call is written now (with
        the calls queued before it), even while earlier calls are unanswered."""
        if threading.get_ident() != self._loop_thread:
            self._hand_to_loop(lambda: self.call(name, keys, args, answer, urgent=urgent))
            return
        self._urgent = self._urgent or urgent
        # evalsha_command, inline: two calls per admitted task come through here.
        self._send(("EVALSHA", script_sha(name), len(keys), *keys, *args), answer, name, keys, args)

    def ping(self, answer: Answer) -> None:
        """PING, answered like a call: a reply proves the store is executing commands
        again (what was sent before it, on any connection, has been read by then)."""
        if threading.get_ident() != self._loop_thread:
            self._hand_to_loop(lambda: self.ping(answer))
            return
        self._send(("PING",), answer)

    def _hand_to_loop(self, call: Callable[[], None]) -> None:
        """From another thread: ``call`` runs on the loop's thread at its next turn."""
        self._from_threads.append(call)
        with contextlib.suppress(OSError):  # full: the loop is woken already; closed
            os.write(self._notify_w, b"!")

    def _send(
        self,
        command: tuple[Any, ...],
        answer: Answer,
        name: str = "",
        keys: Sequence[str] = (),
        args: Sequence[Any] = (),
    ) -> None:
        if self.store.master_watch is not None:
            self._master_changed()
        if self._wire is None:
            watch = self.store.master_watch
            if watch is not None and watch.generation() != self._generation:
                # Sentinel named a new master since the last attempt: the back-off was
                # for the old one; connect to the new one now.
                self._down_until, self._backoff = 0.0, BACKOFF_START
            wait = self._down_until - time.monotonic()
            if wait > 0:
                # On the event loop: answer, never raise, and never wait.
                down = ConnectionError(f"the store failed; not asked again for {wait:.2f}s")
                answer(self.store.unavailable(down))
                return
            self._connect()
        self._out.append(command)
        self._pending.append((answer, name, keys, args, time.monotonic()))
        if self._urgent:
            # Urgent (a pool process idles until the answer): written now, with what
            # was queued before it, not after the rest of this loop turn (the other
            # events of its poll, the timers, the transport's and the pool's own
            # on_tick work): the store answers meanwhile. (Only the loop's thread
            # gets here: a call from another thread is handed to it.)
            self._write()

    def _write(self) -> None:
        """Write every queued call in one write (the loop calls this just before it
        polls), unless an earlier write is still unanswered: then they wait for its
        replies, and meanwhile more calls join them. The store reads a write with one
        read and answers it with one write: under load, far fewer system calls on both
        sides than a write per call or per loop turn.

        An urgent call (a gate ask made on a reserved pool slot: the slot idles until
        the answer) does not wait: waiting for a release's reply first would leave the
        slot idle for two round trips instead of one."""
        if not self._out or self._wire is None:
            return
        if self.store.master_watch is not None and self._master_changed():
            return  # every queued call was answered with StoreUnavailable
        if len(self._pending) > len(self._out) and not self._urgent:
            return  # calls written earlier are unanswered (the queued ones are the last)
        out, self._out, self._urgent = self._out, [], False
        try:
            self._wire.send(*out)
        except BaseException as exc:
            self._broken(exc)

    def _master_changed(self) -> bool:
        """Sentinel named a new master since this wire connected: it may still reach the
        old one, which accepts writes the new master never sees. Drop it."""
        watch = self.store.master_watch
        if watch is None or self._wire is None or watch.generation() == self._generation:
            return False
        # Not a failure of the store: the next call connects (to the new master) at once.
        self._broken(ConnectionError("the store's master changed"), backoff=False)
        return True

    def _connect(self) -> None:
        """Connect on a thread (the calls queue meanwhile); ``_on_connected`` takes over."""
        if self._connecting is not None:
            return
        watch = self.store.master_watch
        self._generation = watch.generation() if watch is not None else 0
        self._connecting = threading.Thread(
            target=self._connect_in_background, name="baton-channel-connect", daemon=True
        )
        self._connecting.start()

    def _connect_in_background(self) -> None:
        try:
            self._connected = self._open()
        except BaseException as exc:  # handed to the loop, which answers the calls
            self._connected = exc
        with contextlib.suppress(OSError):  # full or closed: the loop is told already
            os.write(self._notify_w, b"!")

    def _open(self) -> Wire:
        pool = self.store.client.connection_pool
        conn = pooled_connection(pool)
        try:
            wire = Wire(conn)
            # Load the scripts once per connection: NOSCRIPT then only follows a
            # SCRIPT FLUSH, handled below.
            wire.send(*[("SCRIPT", "LOAD", script_source(n)) for n in ("gate", "release")])
            for _ in range(2):
                reply = wire.read()
                if isinstance(reply, Exception):
                    raise reply
        except BaseException:
            conn.disconnect()
            pool.release(conn)
            raise
        return wire

    def _on_notified(self, *args: Any) -> None:
        """On the loop: the connector finished, or calls were made on other threads."""
        # The loop's thread is the one that reads this pipe. The channel is built where
        # the worker is built, which need not be where its loop runs (Celery's test
        # worker, celery.contrib.testing, builds it on the test's thread and runs it on
        # another): every call made on the loop was handed over again, and none sent.
        self._loop_thread = threading.get_ident()
        with contextlib.suppress(OSError):
            os.read(self._notify_r, 4096)
        self._on_connected()
        self._send_from_threads()

    def _send_from_threads(self) -> None:
        waiting = len(self._from_threads)  # (off the loop, each would be handed back)
        for _ in range(waiting):
            self._from_threads.popleft()()
        if waiting:
            self._write()  # at once: the loop may poll for a while before its next tick

    def _on_connected(self) -> None:
        """On the loop: the connector finished. Use its connection, or answer the calls
        that waited for it with its error."""
        thread, self._connecting = self._connecting, None
        result, self._connected = self._connected, None
        if thread is None or result is None:
            return
        if isinstance(result, BaseException):
            self._broken(result)
            return
        if self._wire is not None:  # cannot happen (one connector at a time); be safe
            self._close_wire(result)
            return
        self._wire = result
        self._connected_at = time.monotonic()
        self._fd = result.fileno()
        self.hub.add_reader(self._fd, self._on_readable)
        self._write()  # the calls that waited for it (none is written yet)

    def _on_readable(self, *args: Any) -> None:
        self._answer_replies(Wire.read_ready)

    def _answer_replies(self, read: Callable[[Wire], list[Any]]) -> None:
        """Answer the pending calls with the replies ``read`` takes from the wire."""
        wire = self._wire
        if wire is None:
            return
        try:
            for reply in read(wire):
                self._answer_next(reply)
        except STORE_ERRORS as exc:
            self._broken(exc)

    def flush(self) -> None:
        """Write what is buffered and wait for every pending answer (at shutdown); what
        cannot be answered is answered StoreUnavailable (releases go to their retry)."""
        connecting = self._connecting
        if connecting is not None:
            connecting.join(timeout=3 * self.timeout + 1)
            self._on_connected()
        self._send_from_threads()
        self._write()
        wire = self._wire
        try:
            while self._pending and wire is not None and wire is self._wire:
                self._write()  # what waited for the replies just read
                self._answer_next(wire.read())
        except STORE_ERRORS as exc:
            self._broken(exc)
        if self._pending:
            self._broken(ConnectionError("not connected at shutdown"))

    def _answer_next(self, reply: Any) -> None:
        """Answer the oldest pending call with ``reply``."""
        if not self._pending:
            return  # answered already: the connection broke meanwhile
        if isinstance(reply, STORE_REPLY_ERRORS):
            raise reply  # LOADING, READONLY...: every pending call gets StoreUnavailable
        answer, name, keys, args, _ = self._pending.popleft()
        self._backoff = BACKOFF_START  # it answers: the next break starts over
        if isinstance(reply, NoScriptError):
            # Someone flushed the scripts. Replies to calls sent after this one are
            # still on their way, so load the script as one more pipelined command
            # (its reply comes back in order) and send this call after it.
            self._send(("SCRIPT", "LOAD", script_source(name)), _ignore)
            self.call(name, keys, args, answer)
            return
        answer(reply)

    def _check_overdue(self) -> None:
        if self._overdue():
            # The loop may not have read for a while (a body running on solo's loop, a
            # loop that stood still on a loaded machine): a reply (or a connection) that
            # arrived meanwhile is not overdue, and the store is not down.
            self._read_what_arrived()
            if self._overdue():
                self._broken(TimeoutError(f"no reply from the store in {self.timeout:g}s"))

    def _overdue(self) -> bool:
        """Whether the oldest call has waited over the timeout for its reply, counted from
        when it could be written (a call queued while connecting waits for the connection
        first, which has a timeout of its own)."""
        if not self._pending:
            return False
        return time.monotonic() - max(self._pending[0][4], self._connected_at) > self.timeout

    def _read_what_arrived(self) -> None:
        if self._connected is not None:  # the connector is done: its notice is unread
            self._on_connected()
        self._answer_replies(Wire.read_arrived)

    def _broken(self, exc: BaseException, *, backoff: bool = True) -> None:
        """Drop the connection and answer every pending call with StoreUnavailable;
        with ``backoff``, new calls are answered at once for a while (the store failed)."""
        if self._wire is not None:
            if self._fd is not None:
                with contextlib.suppress(Exception):  # gone already if the loop was reset
                    self.hub.remove_reader(self._fd)
            self._close_wire(self._wire)
            self._wire = None
            self._fd = None
        if backoff:
            self._down_until = time.monotonic() + self._backoff
            self._backoff = min(BACKOFF_MAX, self._backoff * 2)
        self._out = []
        pending, self._pending = self._pending, deque()
        error = self.store.unavailable(exc)
        for answer, *_ in pending:
            answer(error)

    def _close_wire(self, wire: Wire) -> None:
        try:
            wire.close()
        except Exception:  # already broken; nothing more to do
            logger.debug("disconnect failed", exc_info=True)
        with contextlib.suppress(Exception):  # back to the pool: it counts its connections
            self.store.client.connection_pool.release(wire.conn)

    def close(self) -> None:
        self.hub.on_tick.discard(self._write)
        try:
            self._ticker.cancel()
        except Exception:  # the timer may be gone with the consumer
            logger.debug("cancel failed", exc_info=True)
        self._broken(ConnectionError("channel closed"), backoff=False)
        with contextlib.suppress(Exception):
            self.hub.remove_reader(self._notify_r)
        for fd in (self._notify_r, self._notify_w):
            with contextlib.suppress(OSError):
                os.close(fd)
