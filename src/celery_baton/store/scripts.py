"""Loads the Lua scripts in ``lua/`` and runs them with EVALSHA (reloading on NOSCRIPT).

One script per store operation; each file's header says what its KEYS and ARGV are
and what it returns. Scripts read the clock with ``TIME`` on the server, never the
caller's clock, so workers with skewed clocks agree.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from functools import cache
from importlib import resources
from typing import Any

from redis.exceptions import (
    BusyLoadingError,
    MasterDownError,
    NoScriptError,
    ReadOnlyError,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError

from celery_baton.wire import Wire, pooled_connection

#: Seconds a line may sit idle before it is checked for a close by the server.
IDLE_CHECK = 1.0

SCRIPT_NAMES = (
    "gate",
    "release",
    "renew",
    "unique_claim",
    "unique_release",
    "unique_replace",
    "supersede_stamp",
    "ordered_stamp",
    "unique_keep",
    "unlock",
    "limit_penalize",
    "limit_give_back",
    "beat_lead",
    "beat_resign",
    "beat_claim",
    "beat_sent",
    "beat_define",
    "beat_remove",
    "beat_mark",
    "beat_missed",
    "debounce_record",
    "debounce_decide",
    "throttle_decide",
    "throttle_started",
    "cancel_mark",
    "cancel_id",
    "cancel_key",
    "cancel_check",
    "cancel_read",
    "held_for_later",
    "held_start",
    "fair_leave",
    "batch_tick",
    "batch_done",
    "batch_end",
)


#: gate.lua's kinds of condition, a file each in lua/gate/ with its check and its write,
#: in the order the script tests a condition's kind: the commonest first.
GATE_KINDS = (
    "lease",
    "rate",
    "penalty",
    "override",
    "fair",
    "done",
    "slot_not_run",
    "order",
    "not_superseded",
    "free_unique",
    "keep_unique",
    "not_cancelled",
    "ordered",
    "claim_unique",
)


@cache
def script_source(name: str) -> str:
    if name == "gate":
        return join_gate(_lua_file)
    return with_includes(_lua_file(f"{name}.lua"), _lua_file)


#: A script's line that stands for a shared file's text: ``-- @include batch/done.lua``.
INCLUDE = "-- @include "


def with_includes(source: str, read: Callable[[str], str]) -> str:
    """``source`` with each ``-- @include <path>`` line replaced by that file's text
    (a path under lua/): pieces several scripts share (their local functions) are
    written once, and each script still runs as one chunk."""
    lines = []
    for line in source.splitlines():
        if line.startswith(INCLUDE):
            lines += read(line[len(INCLUDE) :].strip()).splitlines()
        else:
            lines.append(line)
    return "\n".join(lines) + "\n"


def _lua_file(path: str) -> str:
    # One part per joinpath: Python 3.10 takes no more (the package supports 3.10).
    where = resources.files("celery_baton.store") / "lua"
    for part in path.split("/"):
        where = where / part
    return where.read_text()


def join_gate(read: Callable[[str], str]) -> str:
    """gate.lua as the store runs it: one script, the frame (lua/gate.lua) with each
    kind's sections (lua/gate/<kind>.lua: ``--: setup``, ``--: check``, ``--: write``)
    and the store epochs (lua/gate/epochs.lua) put in place of its ``-- @`` lines.
    Joined once, when first loaded; the script that runs is one chunk, as if written
    in one file. ``read(path)``: a file's text by its path under lua/."""
    parts: dict[str, list[str]] = {"setup": [], "check": [], "write": [], "epochs": []}
    for kind in (*GATE_KINDS, "epochs"):
        section = None
        for line in read(f"gate/{kind}.lua").splitlines():
            if line.startswith("--: "):
                section = parts[line[4:].strip()]
            elif section is not None:  # before the first section: the file's header
                section.append(line)
    # Each kind's check (and write) is a branch "elseif kind == ..."; the first opens.
    for chain in ("check", "write"):
        first = next(i for i, line in enumerate(parts[chain]) if line.strip())
        parts[chain][first] = parts[chain][first].replace("elseif", "if", 1)
    joined = []
    for line in read("gate.lua").splitlines():
        place = line.strip()
        if place.startswith("-- @"):
            joined += parts[place[4:].split(":")[0]]
        else:
            joined.append(line)
    return "\n".join(joined) + "\n"


@cache
def script_sha(name: str) -> str:
    return hashlib.sha1(script_source(name).encode()).hexdigest()


def evalsha_command(name: str, keys: Sequence[str], args: Sequence[Any]) -> tuple[Any, ...]:
    """The EVALSHA command that runs script ``name``."""
    return ("EVALSHA", script_sha(name), len(keys), *keys, *args)


class Pending:
    """A script call sent on this thread's connection whose reply is not read yet (or,
    ``pooled``, to be made on a connection of redis-py's pool when its reply is asked)."""

    __slots__ = ("args", "keys", "name", "pooled", "reply")

    def __init__(
        self, name: str, keys: Sequence[str], args: Sequence[Any], *, pooled: bool = False
    ) -> None:
        self.name = name
        self.keys = keys
        self.args = args
        self.pooled = pooled
        self.reply: Any = _UNREAD


_UNREAD: Any = object()

#: Error replies that mean "this connection cannot serve us now", not "the call failed".
STORE_REPLY_ERRORS = (BusyLoadingError, ReadOnlyError, MasterDownError, RedisConnectionError)


def _as_reply(exc: BaseException) -> Exception:
    """What a call whose reply was lost answers (KeyboardInterrupt and the like become a
    ConnectionError: they must not be raised again to another caller)."""
    return exc if isinstance(exc, Exception) else ConnectionError(str(exc))


class _Forks:
    """Counts forks into this process (cheaper than asking for the pid on every call)."""

    count = 0

    @classmethod
    def forked(cls) -> None:
        cls.count += 1


os.register_at_fork(after_in_child=_Forks.forked)


class _Line:
    """This thread's connection and the calls sent on it, oldest first."""

    __slots__ = ("forks", "generation", "used_at", "waiting", "wire")

    def __init__(self, wire: Wire, generation: int) -> None:
        self.wire = wire
        self.forks = _Forks.count
        self.generation = generation  # of the store's master when it connected
        self.waiting: deque[Pending] = deque()
        self.used_at = time.monotonic()


def _alive(thread: weakref.ref[threading.Thread]) -> bool:
    found = thread()
    return found is not None and found.is_alive()


class Scripts:
    """The registered scripts of one client: ``scripts.run("gate", keys, args)``."""

    def __init__(self, client: Any, *, generation: Callable[[], int] | None = None) -> None:
        """``generation``: grows when the store's master changed (Sentinel); a line
        connected before the change is dropped, since it may still reach the old master."""
        self._client = client
        self._generation = generation
        self._registered: dict[str, Any] = {}
        self._local = threading.local()
        # assumes: a thread lives long, so its own connection (its line) is reused.
        # gevent and eventlet make threading.local per greenlet, and a greenlet lives for
        # one task or one timer entry: a line each would leak a connection of the pool
        # each time (redis-py's 100 are gone within seconds; tests/pools/test_bounds.py).
        # There every call takes a connection from the pool and gives it back.
        per_greenlet = type(self._local).__module__ != "_thread"
        self._pool: Any = getattr(client, "connection_pool", None)  # None: Redis Cluster
        self._lines = self._pool is not None and not per_greenlet
        # Each line with the thread it belongs to: a line whose thread ended goes back
        # to the pool when the next line is made (a thread per request, a timer thread
        # per call: each kept one of redis-py's 100 connections for good, issue 38).
        self._owners: list[tuple[weakref.ref[threading.Thread], _Line]] = []
        self._owners_lock = threading.Lock()
        self._owners_forks = _Forks.count

    def connect_ahead(self) -> None:
        """Open one connection of the pool now and leave it there, connected: the next
        line made in this process takes it instead of connecting then (a TCP handshake
        and redis-py's own greeting: milliseconds). Raises the store's errors."""
        if self._pool is None:
            return  # Redis Cluster: a connection per node, made by its own client
        self._pool.release(pooled_connection(self._pool))

    def call(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """The hot path: one EVALSHA; on NOSCRIPT (a restarted or flushed server) load the
        script and send it again.

        A worker calls this for every task, so it skips redis-py's per-command machinery
        (pool checkout, retry wrapper, instrumentation: about half the client CPU of a
        call) and talks on a connection of its own per thread (see ``wire``).
        """
        if not self._lines or self._interrupting():
            return self._call_pooled(name, keys, args)
        return self.result(self.send(name, keys, args))

    def _call_pooled(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """The call on a connection of redis-py's pool (Cluster, greenlets, a signal
        handler's call): checked out and given back by the client."""
        sha = script_sha(name)
        try:
            return self._client.evalsha(sha, len(keys), *keys, *args)
        except NoScriptError:
            self._client.script_load(script_source(name))
            return self._client.evalsha(sha, len(keys), *keys, *args)

    def _interrupting(self) -> bool:
        """Whether this call interrupts one of this thread writing or reading its line
        (it runs in a signal handler: ``Wire.in_io``)."""
        line: _Line | None = getattr(self._local, "line", None)
        return line is not None and line.wire.in_io

    def send(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Pending:
        """Write a call now and read its reply later with ``result``, on the same thread:
        the round trip then overlaps whatever the caller does meanwhile. Raises the
        store's errors."""
        if not self._lines or self._interrupting():
            # Cluster, greenlets, a signal handler's call: no line; it runs in result().
            return Pending(name, keys, args, pooled=True)
        line = self._line()
        pending = Pending(name, keys, args)
        try:
            line.wire.send(evalsha_command(name, keys, args))
        except BaseException as exc:
            self._drop(line, exc)
            raise
        line.waiting.append(pending)
        return pending

    def result(self, pending: Pending) -> Any:
        """The reply of a call ``send`` wrote; raises its error reply or the store's."""
        if pending.pooled:
            if pending.reply is _UNREAD:
                pending.reply = self._call_pooled(pending.name, pending.keys, pending.args)
            return pending.reply
        line = self._line()
        try:
            while pending.reply is _UNREAD:
                if not line.waiting:  # its line broke and was replaced
                    raise ConnectionError("the store connection was reset")
                self._read_one(line)
        except BaseException as exc:
            self._drop(line, exc)
            raise
        reply = pending.reply
        if isinstance(reply, Exception):
            raise reply
        return reply

    def _read_one(self, line: _Line) -> None:
        """Read the oldest call's reply; on NOSCRIPT load the script and send it again
        (its reply then comes after those of the calls sent since)."""
        head = line.waiting.popleft()
        try:
            reply = line.wire.read()
            if isinstance(reply, STORE_REPLY_ERRORS):
                raise reply  # LOADING, READONLY (a failed-over master)...: reconnect
        except BaseException as exc:
            head.reply = _as_reply(exc)
            raise
        if isinstance(reply, NoScriptError):
            line.wire.send(
                ("SCRIPT", "LOAD", script_source(head.name)),
                evalsha_command(head.name, head.keys, head.args),
            )
            line.waiting.append(Pending("", (), ()))  # the SCRIPT LOAD's reply
            line.waiting.append(head)
            return
        head.reply = reply

    def _line(self) -> _Line:
        line: _Line | None = getattr(self._local, "line", None)
        generation = self._generation() if self._generation is not None else 0
        if line is not None and line.generation != generation and line.forks == _Forks.count:
            self._drop(line, ConnectionError("the store's master changed"))
            line = None
        if line is not None and not line.waiting and line.forks == _Forks.count:
            now = time.monotonic()
            # A line idle for a while may have been closed by the server (a restart, a
            # failover): check before writing on it, or the first call after the store
            # came back would fail. Busy lines are not checked (no cost on the hot path).
            if now - line.used_at > IDLE_CHECK and line.wire.closed_by_peer():
                self._drop(line, ConnectionError("closed by the store while idle"))
                line = None
            else:
                line.used_at = now
        if line is None or line.forks != _Forks.count:
            # New, or inherited through fork (a pool child): the parent's socket is not
            # ours to use or to close.
            line = self._local.line = self._new_line(generation)
        return line

    def _new_line(self, generation: int) -> _Line:
        if self._owners_forks != _Forks.count:
            # A forked child: the parent's lines are not ours to give back, and a thread
            # of the parent may have held the lock as it forked.
            self._owners, self._owners_lock = [], threading.Lock()
            self._owners_forks = _Forks.count
        self._reap()
        line = _Line(Wire(pooled_connection(self._pool)), generation)
        with self._owners_lock:
            self._owners.append((weakref.ref(threading.current_thread()), line))
        return line

    def _reap(self) -> None:
        """Give back to the pool the connections of lines whose thread ended."""
        with self._owners_lock:
            ended = [o for o in self._owners if not _alive(o[0])]
            if not ended:
                return
            self._owners = [o for o in self._owners if _alive(o[0])]
        for _, line in ended:
            self._give_back(line)

    def _give_back(self, line: _Line) -> None:
        """``line``'s connection back to the pool: closed when replies may still come on
        it (or it broke); never one inherited through fork (the parent's)."""
        if line.forks != _Forks.count:
            return
        conn = line.wire.conn
        if line.waiting:
            with contextlib.suppress(Exception):  # already broken
                conn.disconnect()
        with contextlib.suppress(Exception):
            self._pool.release(conn)

    def _drop(self, line: _Line, exc: BaseException) -> None:
        """After an error the connection's state is unknown: answer every call still
        waiting on it with the error and start clean next time."""
        if isinstance(exc, ResponseError) and not isinstance(exc, STORE_REPLY_ERRORS):
            return  # an error reply: the connection itself is fine
        for waiting in line.waiting:
            waiting.reply = _as_reply(exc)
        line.waiting.clear()
        self._local.line = None
        with contextlib.suppress(Exception):  # already broken
            line.wire.close()
        # Back to the pool, closed (it reconnects when handed out again): a line dropped
        # on every store error kept one of the pool's connections each (issue 38).
        if line.forks == _Forks.count == self._owners_forks:
            with self._owners_lock:
                self._owners = [o for o in self._owners if o[1] is not line]
        self._give_back(line)

    def _script(self, name: str) -> Any:
        script = self._registered.get(name)
        if script is None:
            # redis-py's Script sends EVALSHA and falls back to loading on NOSCRIPT,
            # also inside pipelines (it loads the scripts before the pipeline runs).
            script = self._client.register_script(script_source(name))
            self._registered[name] = script
        return script

    def call_many(
        self, name: str, calls: Sequence[tuple[Sequence[str], Sequence[Any]]]
    ) -> list[Any]:
        """Several calls of one script in one round trip (pipelined, not a transaction)."""
        if not self._lines or len(calls) == 1 or self._interrupting():
            return [self.call(name, keys, args) for keys, args in calls]
        line = self._line()
        pending = [Pending(name, keys, args) for keys, args in calls]
        try:
            # EVALSHA alone: a NOSCRIPT reply (a restarted or flushed server) loads the
            # script and sends that call again (_read_one), each in turn, so they still
            # run in the order given. (A SCRIPT LOAD in every write cost the store a
            # digest of the whole script per call: 15 KB for a batching tick.)
            line.wire.send(*[evalsha_command(name, keys, args) for keys, args in calls])
        except BaseException as exc:
            self._drop(line, exc)
            raise
        line.waiting.extend(pending)
        return [self.result(p) for p in pending]

    def run(self, name: str, keys: Sequence[str], args: Sequence[Any], client: Any = None) -> Any:
        """Run script ``name``; ``client`` may be a pipeline of the same connection."""
        if client is None:
            return self.call(name, keys, args)
        if self._pool is None:
            # A Redis Cluster pipeline: redis-py refuses EVALSHA there (and could not
            # load a script missing on the node: a promoted replica has an empty script
            # cache), so send the script itself. Only the beat pipelines script calls,
            # a few per second at most: the bytes do not matter.
            return client.execute_command("EVAL", script_source(name), len(keys), *keys, *args)
        return self._script(name)(keys=keys, args=args, client=client)
