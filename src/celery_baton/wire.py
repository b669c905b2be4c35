"""One Redis-protocol connection spoken to directly: the hot path's commands and replies
(the store's, and the worker's own to its broker for kombu's writes:
``worker/transport/broker_writes.py``).

redis-py connects (address, TLS, AUTH, SELECT, Sentinel discovery, client name); after
that, ``Wire`` writes commands packed by hiredis straight to the socket and feeds what
it reads to a hiredis reader of its own. That skips redis-py's per-command checks and
wrappers, and lets one ``recv`` bring in every reply that has arrived, so a caller can
send a command, do other work, and read the reply later (``send`` / ``read``), or let
an event loop collect replies when the socket is readable (``read_ready``).

A socket with a timeout makes CPython poll it before every ``send`` and ``recv`` (two
system calls where one does): on a plain socket the hot path writes and reads its file
descriptor directly instead, which never waits (it is non-blocking, or the event loop
said it is readable), and falls back to the socket's own calls, with their timeout, only
for what a write could not take at once. TLS sockets keep the socket's calls.

Replies come back in the order the commands were sent. An error reply is returned as
an exception *instance* (redis-py's class for it, e.g. ``NoScriptError``), never
raised, so that one error cannot make a caller lose its place in the reply stream.
A broken socket raises ``redis.ConnectionError`` / ``redis.TimeoutError``; the wire
is then unusable and must be closed.
"""

from __future__ import annotations

import functools
import inspect
import os
import select
import socket
import ssl
from collections.abc import Sequence
from typing import Any

import hiredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

try:  # redis-py's mapping of error replies to exception classes (NOSCRIPT, LOADING...)
    from redis._parsers.base import BaseParser

    _reply_error: Any = BaseParser.parse_error
except (ImportError, AttributeError):  # pragma: no cover - other redis-py layouts
    _reply_error = ResponseError

READ_SIZE = 65536
#: Reads of what arrived that one ``read_arrived`` makes at most (each up to READ_SIZE).
_ARRIVED_READS_MAX = 64
_pack = hiredis.pack_command


def pooled_connection(pool: Any) -> Any:
    """A connection from redis-py's ``pool``. redis-py before 5.3 requires a command
    name (unused since); 5.3 and later warn when given one. Celery 5.5's kombu pins
    redis-py 5.2 or older."""
    if _needs_command_name(pool.get_connection.__func__):
        return pool.get_connection("PING")
    return pool.get_connection()


@functools.cache
def _needs_command_name(get_connection: Any) -> bool:
    parameter = inspect.signature(get_connection).parameters.get("command_name")
    return parameter is not None and parameter.default is inspect.Parameter.empty


class Wire:
    """A connected redis-py ``Connection``'s socket, used directly."""

    __slots__ = ("_fd", "_reader", "_sock", "conn", "in_io")

    def __init__(self, conn: Any) -> None:
        conn.connect()  # a no-op when the pool handed out a connected one
        self.conn = conn
        # Writing or reading now (``send``, ``read``): a call made meanwhile on the same
        # thread comes from a signal handler (Celery's beat resigns its lease in its
        # SIGTERM handler) and must not use this connection: it would read the reply of
        # the call it interrupted (store/scripts.py sends it on another).
        self.in_io = False
        self._sock: socket.socket = conn._sock
        # The descriptor written and read directly (-1: use the socket's calls; TLS, or
        # a system whose sockets are not file descriptors).
        self._fd = (
            self._sock.fileno()
            if os.name == "posix" and not isinstance(self._sock, ssl.SSLSocket)
            else -1
        )
        encoder = conn.encoder
        self._reader = hiredis.Reader(
            replyError=_reply_error,
            encoding=encoder.encoding if encoder.decode_responses else None,
            errors=encoder.encoding_errors,
        )

    def fileno(self) -> int:
        return self._sock.fileno()

    def closed_by_peer(self) -> bool:
        """Whether the server closed this idle connection (it restarted, failed over, or
        dropped idle clients): an idle socket has nothing to read, so one that polls as
        readable holds EOF, an error or bytes nobody asked for. A zero-timeout poll: it
        never waits (a recv would wait up to the socket timeout), consumes nothing."""
        try:
            readable, _, _ = select.select([self._sock], [], [], 0)
        except (OSError, ValueError):
            return True
        return bool(readable)

    def send(self, *commands: Sequence[Any]) -> None:
        """Write one or more commands in one write."""
        data = (
            _pack(tuple(commands[0]))
            if len(commands) == 1
            else b"".join(_pack(tuple(command)) for command in commands)
        )
        self.in_io = True
        try:
            if self._fd >= 0:
                try:
                    sent = os.write(self._fd, data)  # no poll first (see the top)
                except BlockingIOError:
                    sent = 0
                if sent == len(data):
                    return
                data = data[sent:]
            # What the kernel could not take at once: wait for room, up to the timeout.
            self._sock.sendall(data)
        except OSError as exc:
            raise _broken(exc) from exc
        finally:
            self.in_io = False

    def read(self) -> Any:
        """The next reply, waiting for it (up to the connection's socket timeout)."""
        self.in_io = True
        try:
            reply = self._reader.gets()
            while reply is False:
                self._receive()
                reply = self._reader.gets()
            return reply
        finally:
            self.in_io = False

    def read_arrived(self) -> list[Any]:
        """Every complete reply that has arrived, read without the event loop's word that
        the socket is readable (a check that replies are overdue, made by a loop that
        may not have read for a while): it reads only while there is something to read,
        so it never waits."""
        replies: list[Any] = []
        for _ in range(_ARRIVED_READS_MAX):
            try:
                readable, _, _ = select.select([self._sock], [], [], 0)
            except ValueError as exc:  # closed: no descriptor left
                raise RedisConnectionError("the connection is closed") from exc
            except OSError as exc:
                raise _broken(exc) from exc
            if not readable:
                break
            replies.extend(self.read_ready())
        return replies

    def read_ready(self) -> list[Any]:
        """Every complete reply that has arrived; for an event loop whose poller said the
        socket is readable (reads once, so it never blocks)."""
        if self._fd >= 0:
            try:
                data = os.read(self._fd, READ_SIZE)  # no poll first (see the top)
            except BlockingIOError:
                data = None  # nothing after all: the poller was early; no reply yet
            except OSError as exc:
                raise _broken(exc) from exc
            if data is not None:
                if not data:
                    raise RedisConnectionError("the store closed the connection")
                self._reader.feed(data)
        else:
            self._receive()
        # TLS: decrypted bytes can wait inside the SSL object while the socket itself
        # has nothing more to read, and the poller would not report them.
        while isinstance(self._sock, ssl.SSLSocket) and self._sock.pending():
            self._receive()
        replies = []
        reply = self._reader.gets()
        while reply is not False:
            replies.append(reply)
            reply = self._reader.gets()
        return replies

    def _receive(self) -> None:
        try:
            data = self._sock.recv(READ_SIZE)
        except OSError as exc:
            raise _broken(exc) from exc
        if not data:
            raise RedisConnectionError("the store closed the connection")
        self._reader.feed(data)

    def close(self) -> None:
        self.conn.disconnect()


def _broken(exc: OSError) -> Exception:
    if isinstance(exc, socket.timeout | TimeoutError):
        return RedisTimeoutError(f"no reply from the store in time: {exc}")
    return RedisConnectionError(f"store connection broken: {exc}")
