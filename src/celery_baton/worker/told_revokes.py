"""A revoke told on the store's notice channel, run by a worker without remote control.

A worker started with ``worker_enable_remote_control=False`` has no mailbox, so Celery's
``revoke`` broadcast never reaches it; celery-baton tells each of its revokes on the
notice channel too (core/revoke_notices.py). Such a worker runs the revoke here as its
mailbox would have: Celery's own handler (with what celery-baton adds to it), on the
consumer's loop thread, with the state the mailbox gives its handlers. A cancel by key
names its calls by their key: the calls this worker runs that have it are the ones
revoked, as the caller matches those ``inspect active`` lists.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from celery.utils.collections import AttributeDict
from celery.worker import state as worker_state

from celery_baton import internals
from celery_baton.core.cancels import KeyCancel, covering
from celery_baton.core.revoke_notices import KEY_ARG

logger = logging.getLogger("celery_baton.worker")


def takes_told_revokes(app: Any) -> bool:
    """Whether this worker's revokes come only from the notice channel."""
    return not app.conf.get("worker_enable_remote_control", True)


def revoke_told(consumer: Any, arguments: Mapping[str, Any]) -> None:
    """Run Celery's ``revoke`` handler with the told ``arguments`` (on the loop thread;
    at once where there is no loop: gevent, eventlet). Nothing escapes: on the notice
    listener's thread a failure would restart its subscription."""
    try:
        _revoke(consumer, arguments)
    except Exception:
        logger.exception("baton: a revoke told on the notice channel failed: %s", arguments)


def _revoke(consumer: Any, arguments: Mapping[str, Any]) -> None:
    panel = internals.control_panel()
    if panel is None:
        return
    kwargs = dict(arguments)
    key = kwargs.pop(KEY_ARG, None)
    task_ids = kwargs.pop("task_id", None)
    if isinstance(key, list) and len(key) == 2:
        task_ids = _running_of_key(consumer.app, str(key[0]), str(key[1]))
    if not task_ids:
        return
    logger.info(
        "baton: revoke of %s told on the store's notice channel (this worker takes no "
        "remote control)",
        task_ids,
    )
    state = AttributeDict(app=consumer.app, hostname=consumer.hostname, consumer=consumer, tset=set)
    panel["revoke"](state, task_ids, **kwargs)


def _running_of_key(app: Any, name: str, material: str) -> list[str]:
    task = app.tasks.get(name)
    fun = getattr(task, "run", None)
    cancel = [KeyCancel(0, material)]
    return [
        request.id
        for request in list(worker_state.active_requests)
        if request.name == name
        and covering(name, cancel, {}, fun, request.args, request.kwargs, None) is not None
    ]
