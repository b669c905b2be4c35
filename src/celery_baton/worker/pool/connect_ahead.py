"""A new pool process connects to the store as it starts, not at its first run's end.

A prefork pool process makes its own store connection (the parent's is not its to
use): it used to be made by the first call that needed it, the record of its first
guarded run's end, while that run still held its key and its pool slot. The TCP
handshake and redis-py's greeting cost that run 6-7 ms (``bench/timeline.py
--handoffs``: the two slowest hand-offs of a key to another worker were each pool
process's first run), and every process a ``--max-tasks-per-child`` or ``--autoscale``
pool forks later paid it again.

So each pool process connects as it starts (``worker_process_init``), on a thread of
its own: a store that is down or stopped holds up nothing (the process is up, and its
first call then connects as before, or fails as before).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from celery import current_app, signals

from celery_baton.parts import AppParts

logger = logging.getLogger("celery_baton.worker")


def install(parts: AppParts) -> None:
    def connect_ahead(**_: Any) -> None:
        if current_app._get_current_object() is not parts.app:
            return  # another app's worker: its own parts connect
        threading.Thread(
            target=_connect, args=(parts,), name="baton-connect-ahead", daemon=True
        ).start()

    signals.worker_process_init.connect(
        connect_ahead, weak=False, dispatch_uid=f"baton-connect-ahead-{id(parts.app)}"
    )


def _connect(parts: AppParts) -> None:
    try:
        parts.gate.connect_ahead()
    except Exception as error:  # its first call connects, or says the store is down
        logger.debug("baton: connecting to the store ahead of the first run failed: %s", error)
