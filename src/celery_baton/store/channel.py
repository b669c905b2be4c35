"""Script calls answered through callbacks, so a worker's event loop never waits on the
store.

``BlockingChannel`` answers at once (for pools without an event loop: solo, threads).
``PipelinedChannel`` queues each call and returns; queued calls are written together
just before the loop polls, the loop calls the channel back when the socket is
readable, and replies are matched to calls in order (Redis answers a connection's
commands in the order it received them). One write is in flight at a time: calls made
while it is unanswered wait for its replies and then go out together. Under load many
calls share a write and a round trip (fewer system calls in the worker and in the
store), and the loop keeps receiving messages meanwhile; when idle, a call is written
at the next loop turn.

Every call gets exactly one answer: the reply, or an exception (``StoreUnavailable``
when the connection broke or a reply took longer than the socket timeout).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from redis.exceptions import NoScriptError, ResponseError

from celery_baton.store.connection import STORE_ERRORS, Store
from celery_baton.store.scripts import STORE_REPLY_ERRORS, evalsha_command, script_source
from celery_baton.store.wire import Wire

logger = logging.getLogger("celery_baton.store")

Answer = Callable[[Any], None]  # called with the reply, or with an exception


def _ignore(reply: Any) -> None:
    """The answer to a command sent for its effect only (SCRIPT LOAD)."""


class BlockingChannel:
    """Calls the store and answers before returning."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def call(self, name: str, keys: Sequence[str], args: Sequence[Any], answer: Answer) -> None:
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
        self._attach(hub, timer)

    def _attach(self, hub: Any, timer: Any) -> None:
        """Run on ``hub``: write before each poll, and check for overdue replies."""
        self.hub = hub
        self._ticker = timer.call_repeatedly(max(0.05, self.timeout / 4), self._check_overdue)
        self._loop_thread = threading.get_ident()
        hub.on_tick.add(self._write)

    def rebind(self, hub: Any, timer: Any) -> None:
        """After the consumer restarted (a lost broker connection): Celery reset the
        event loop, which dropped this channel's socket from the poller and may have
        cancelled its overdue check. Start over on a new connection; calls still
        waiting for a reply are answered with StoreUnavailable (releases are retried
        in the background, and the held requests were given back already)."""
        self._broken(ConnectionError("the worker's event loop was reset"))
        with contextlib.suppress(Exception):  # the timer may have dropped it already
            self._ticker.cancel()
        self._attach(hub, timer)

    def call(self, name: str, keys: Sequence[str], args: Sequence[Any], answer: Answer) -> None:
        self._send(
            *evalsha_command(name, keys, args), answer=answer, name=name, keys=keys, args=args
        )

    def _send(
        self,
        *command: Any,
        answer: Answer,
        name: str = "",
        keys: Sequence[str] = (),
        args: Sequence[Any] = (),
    ) -> None:
        try:
            self._connection()
        except BaseException as exc:  # on the event loop: answer, never raise
            self._broken(exc)
            answer(self.store.unavailable(exc))
            return
        self._out.append(command)
        self._pending.append((answer, name, keys, args, time.monotonic()))
        if threading.get_ident() != self._loop_thread:
            self._write()  # no loop turn will come soon for a call from another thread

    def _write(self) -> None:
        """Write every queued call in one write (the loop calls this just before it
        polls), unless an earlier write is still unanswered: then they wait for its
        replies, and meanwhile more calls join them. The store reads a write with one
        read and answers it with one write: under load, far fewer system calls on both
        sides than a write per call or per loop turn."""
        if not self._out or self._wire is None:
            return
        if self._master_changed():
            return  # every queued call was answered with StoreUnavailable
        if len(self._pending) > len(self._out):
            return  # calls written earlier are unanswered (the queued ones are the last)
        out, self._out = self._out, []
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
        self._broken(ConnectionError("the store's master changed"))
        return True

    def _connection(self) -> Wire:
        self._master_changed()
        if self._wire is None:
            watch = self.store.master_watch
            self._generation = watch.generation() if watch is not None else 0
            wire = Wire(self.store.client.connection_pool.get_connection())
            try:
                # Load the scripts once per connection: NOSCRIPT then only follows a
                # SCRIPT FLUSH, handled below.
                wire.send(*[("SCRIPT", "LOAD", script_source(n)) for n in ("gate", "release")])
                for _ in range(2):
                    reply = wire.read()
                    if isinstance(reply, Exception):
                        raise reply
            except BaseException:
                wire.close()
                raise
            self._wire = wire
            self._fd = wire.fileno()
            self.hub.add_reader(self._fd, self._on_readable)
        return self._wire

    def _on_readable(self, *args: Any) -> None:
        wire = self._wire
        if wire is None:
            return
        try:
            for reply in wire.read_ready():
                self._answer_next(reply)
        except STORE_ERRORS as exc:
            self._broken(exc)

    def flush(self) -> None:
        """Write what is buffered and wait for every pending answer (at shutdown)."""
        self._write()
        wire = self._wire
        try:
            while self._pending and wire is not None and wire is self._wire:
                self._write()  # what waited for the replies just read
                self._answer_next(wire.read())
        except STORE_ERRORS as exc:
            self._broken(exc)

    def _answer_next(self, reply: Any) -> None:
        """Answer the oldest pending call with ``reply``."""
        if not self._pending:
            return  # answered already: the connection broke meanwhile
        if isinstance(reply, STORE_REPLY_ERRORS):
            raise reply  # LOADING, READONLY...: every pending call gets StoreUnavailable
        answer, name, keys, args, _ = self._pending.popleft()
        if isinstance(reply, NoScriptError):
            # Someone flushed the scripts. Replies to calls sent after this one are
            # still on their way, so load the script as one more pipelined command
            # (its reply comes back in order) and send this call after it.
            self._send("SCRIPT", "LOAD", script_source(name), answer=_ignore)
            self.call(name, keys, args, answer)
            return
        answer(reply)

    def _check_overdue(self) -> None:
        if self._pending and time.monotonic() - self._pending[0][4] > self.timeout:
            self._broken(TimeoutError(f"no reply from the store in {self.timeout:g}s"))

    def _broken(self, exc: BaseException) -> None:
        """Drop the connection and answer every pending call with StoreUnavailable."""
        if self._wire is not None:
            if self._fd is not None:
                with contextlib.suppress(Exception):  # gone already if the loop was reset
                    self.hub.remove_reader(self._fd)
            try:
                self._wire.close()
            except Exception:  # already broken; nothing more to do
                logger.debug("disconnect failed", exc_info=True)
            self._wire = None
            self._fd = None
        self._out = []
        pending, self._pending = self._pending, deque()
        error = self.store.unavailable(exc)
        for answer, *_ in pending:
            answer(error)

    def close(self) -> None:
        self.hub.on_tick.discard(self._write)
        try:
            self._ticker.cancel()
        except Exception:  # the timer may be gone with the consumer
            logger.debug("cancel failed", exc_info=True)
        self._broken(ConnectionError("channel closed"))
