"""Loads the Lua scripts in ``lua/`` and runs them with EVALSHA (reloading on NOSCRIPT).

One script per store operation; each file's header says what its KEYS and ARGV are
and what it returns. Scripts read the clock with ``TIME`` on the server, never the
caller's clock, so workers with skewed clocks agree.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from functools import cache
from importlib import resources
from typing import Any

from redis.exceptions import NoScriptError, ResponseError

SCRIPT_NAMES = (
    "gate",
    "release",
    "renew",
    "unique_claim",
    "unique_release",
    "unlock",
    "beat_lead",
    "beat_resign",
    "beat_claim",
    "beat_sent",
    "beat_define",
    "beat_remove",
    "beat_mark",
)


@cache
def script_source(name: str) -> str:
    return resources.files("celery_baton.store").joinpath("lua", f"{name}.lua").read_text()


@cache
def script_sha(name: str) -> str:
    return hashlib.sha1(script_source(name).encode()).hexdigest()


class Scripts:
    """The registered scripts of one client: ``scripts.run("gate", keys, args)``."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self._registered: dict[str, Any] = {}
        self._pool = getattr(client, "connection_pool", None)  # None: Redis Cluster
        self._local = threading.local()

    def call(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """The hot path: one EVALSHA; on NOSCRIPT (a restarted or flushed server) load the
        script and send it again.

        A worker calls this for every task on its event loop, so it skips redis-py's
        per-command machinery (pool checkout, retry wrapper, instrumentation: about half
        the client CPU of a call) and talks on a connection of its own per thread.
        """
        sha = script_sha(name)
        if self._pool is None:
            try:
                return self._client.evalsha(sha, len(keys), *keys, *args)
            except NoScriptError:
                self._client.script_load(script_source(name))
                return self._client.evalsha(sha, len(keys), *keys, *args)
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = self._pool.get_connection()
        try:
            try:
                conn.send_command("EVALSHA", sha, len(keys), *keys, *args)
                return conn.read_response()
            except NoScriptError:
                conn.send_command("SCRIPT", "LOAD", script_source(name))
                conn.read_response()
                conn.send_command("EVALSHA", sha, len(keys), *keys, *args)
                return conn.read_response()
        except ResponseError:
            raise
        except BaseException:
            # Unknown state (timeout mid-reply, broken socket): start clean next time.
            conn.disconnect()
            raise

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
        if self._pool is None or len(calls) == 1:
            return [self.call(name, keys, args) for keys, args in calls]
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = self._pool.get_connection()
        sha = script_sha(name)
        commands = [("EVALSHA", sha, len(keys), *keys, *args) for keys, args in calls]
        try:
            # SCRIPT LOAD first, in the same round trip: NOSCRIPT cannot happen below.
            conn.send_packed_command(
                conn.pack_commands([("SCRIPT", "LOAD", script_source(name)), *commands])
            )
            conn.read_response()
            replies: list[Any] = []
            for _ in commands:
                try:
                    replies.append(conn.read_response())
                except ResponseError as exc:
                    replies.append(exc)
        except BaseException:
            conn.disconnect()
            raise
        for reply in replies:
            if isinstance(reply, ResponseError):
                raise reply
        return replies

    def run(self, name: str, keys: Sequence[str], args: Sequence[Any], client: Any = None) -> Any:
        """Run script ``name``; ``client`` may be a pipeline of the same connection."""
        if client is None:
            return self.call(name, keys, args)
        return self._script(name)(keys=keys, args=args, client=client)
