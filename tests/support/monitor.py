"""What a server runs while a block runs, seen from outside with ``MONITOR``.

Example::

    with monitored(server) as commands:
        ...  # the work
    # complete here: every command the server ran before the block ended is in it
    evalshas = [c for c in commands if c["command"].startswith("EVALSHA")]

Each entry is redis-py's MONITOR dict (``command``, ``db``, ``client_address``,
``client_port``, ``time``). The list is complete when the block exits: an ``ECHO`` of a
marker is sent last and waited for.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis

from tests.support.servers import StoreServer
from tests.support.waiting import wait_until


@contextmanager
def monitored(server: StoreServer, db: int | None = None) -> Iterator[list[dict[str, Any]]]:
    """The commands ``server`` runs (on ``db`` only, when given) while the block runs."""
    seen: list[dict[str, Any]] = []
    marker = f"monitor-end-{time.monotonic_ns()}"
    ready = f"monitor-ready-{time.monotonic_ns()}"
    echoes: list[str] = []

    def listen() -> None:
        # No read timeout: a block may leave the server idle longer than a client's
        # 10 s, and a timed-out listener's exception would fail whichever test runs next
        # in this process.
        idle_ok = redis.Redis.from_url(server.url(0), decode_responses=True)
        with idle_ok, idle_ok.monitor() as monitor:
            for command in monitor.listen():
                text = command["command"]
                if text == f"ECHO {marker}":
                    return
                if text == f"ECHO {ready}":
                    echoes.append(text)
                elif db is None or command["db"] == db:
                    seen.append(command)

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    with server.client() as client:

        def listening() -> bool:
            client.echo(ready)
            return bool(echoes)

        wait_until(listening, 10, "MONITOR listening")
        try:
            yield seen
        finally:  # the listener ends with the block, however the block ends
            # (a failed echo must not hide the block's own error: the assertion below
            # says the listener did not end)
            with contextlib.suppress(redis.RedisError):
                client.echo(marker)
    listener.join(10)
    assert not listener.is_alive(), "MONITOR never saw the end marker"


def transactions(commands: list[dict[str, Any]]) -> list[list[str]]:
    """The commands of each ``MULTI ... EXEC`` block, per client connection (a server
    runs a block's commands when it reads its EXEC; other clients' may come between
    its MULTI and them in the stream); a command outside any block is a block of one."""
    blocks: list[list[str]] = []
    open_blocks: dict[str, list[str]] = {}
    for command in commands:
        who = f"{command['client_address']}:{command['client_port']}"
        text = command["command"]
        verb = text.split(" ", 1)[0].upper()
        if verb == "MULTI":
            open_blocks[who] = []
        elif verb in ("EXEC", "DISCARD"):
            block = open_blocks.pop(who, None)
            if block is not None and verb == "EXEC":
                blocks.append(block)
        elif who in open_blocks:
            open_blocks[who].append(text)
        else:
            blocks.append([text])
    return blocks


def intake_round_trips(commands: list[dict[str, Any]]) -> dict[str, int]:
    """The broker round trips consumers spent taking messages in, by kind: ``BRPOP``
    answers, kombu's own unacked records (``MULTI ZADD HSET EXEC``), and celery-baton's
    intake script's calls (worker/transport/intake_together.py)."""
    counts = {"brpop": 0, "kombu_records": 0, "intake_scripts": 0}
    # A script's own commands are listed too, from the client "lua": not round trips.
    sent = [c for c in commands if c.get("client_address") != "lua"]
    for block in transactions(sent):
        first = block[0].upper() if block else ""
        if first.startswith("BRPOP"):
            counts["brpop"] += 1
        elif first.startswith("ZADD") and "unacked_index" in block[0]:
            counts["kombu_records"] += 1
        elif first.startswith(("EVALSHA", "EVAL ")) and "unacked_index" in block[0]:
            counts["intake_scripts"] += 1
    return counts
