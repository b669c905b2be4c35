"""Revokes told on the store's notice channel, for workers that take no remote control.
Celery-free.

celery-baton stops a running call with Celery's ``revoke`` broadcast: the run an
``exclusive_conflict="replace"`` publish replaces, a call cancelled with
``terminate=True`` (by id, or every running call of a key). A worker started with
``worker_enable_remote_control=False`` has no mailbox: the broadcast never reaches it,
and the replaced run went on to its end (60 s in tests/flow/test_supersede.py) while
its replacement waited. So every such revoke is also published on the notice channel,
which every celery-baton worker listens to; a worker without remote control runs
Celery's own revoke handler on it (a worker with remote control has the broadcast, and
ignores the notice).

A notice is ``MARK``, a newline and the revoke's arguments as JSON (the broadcast's:
``task_id``, ``terminate``, ``signal``, and what celery-baton adds); a cancel by key
names the calls it stops by their key instead (``KEY_ARG``: the task's name and the
key's material), which the worker matches against the calls it runs, as the caller
matches those ``inspect active`` lists (core/cancels.py ``covering``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from celery_baton.store.connection import STORE_ERRORS, Store

logger = logging.getLogger("celery_baton.core.revoke_notices")

MARK = "baton-revoke"
#: A cancel by key's notice: ``[task name, key material]`` (JSON of the key's values).
KEY_ARG = "baton_key"


def revoke_notice(arguments: Mapping[str, Any]) -> str:
    return f"{MARK}\n{json.dumps(dict(arguments))}"


def parse_revoke_notice(text: str) -> dict[str, Any] | None:
    """The revoke's arguments, or None when ``text`` is another notice."""
    if not text.startswith(MARK + "\n"):
        return None
    try:
        arguments = json.loads(text[len(MARK) + 1 :])
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        logger.warning("a revoke notice that cannot be read: %r", text[:200])
        return None
    return arguments


def tell(store: Store, channel: str, arguments: Mapping[str, Any]) -> None:
    """Publish the revoke ``arguments`` on the notice ``channel``; raises the store's
    ``StoreUnavailable``."""
    try:
        store.client.publish(channel, revoke_notice(arguments))
    except STORE_ERRORS as exc:
        raise store.unavailable(exc) from exc
