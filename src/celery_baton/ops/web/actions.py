"""The CLI's actions on the web view (unlock, pause, resume, trigger, cancel): POSTs that
need the server's token (checked by the server before :func:`act` runs)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from celery_baton.errors import BatonError
from celery_baton.ops.state import Schedules, Source, holders_in_words, live_workers
from celery_baton.store import inspect as store_inspect

ACTIONS = ("unlock", "pause", "resume", "trigger", "cancel")

#: ``baton.cancel`` as the web view calls it: ``(task_id, task, key, terminate)`` -> what
#: was cancelled, in words (the CLI's ``baton web`` gives it; it needs Celery).
CancelAction = Callable[[str | None, str | None, Any, bool], str]


class Refused(Exception):
    """An action that did not happen, with the reason an operator reads."""


def act(
    source: Source,
    schedules: Schedules,
    form: Mapping[str, str],
    cancel: CancelAction | None = None,
) -> str:
    """Run one action of the CLI; returns what happened, raises :class:`Refused`."""
    action = form.get("action", "")
    try:
        if action == "cancel":
            return _cancel(form, cancel)
        if action == "unlock":
            key = form.get("key", "")
            force = form.get("force") in ("1", "on", "true")
            if not store_inspect.exists(source.store, key):
                raise Refused(f"{key}: no such lease or unique claim")
            removed, live = store_inspect.unlock(
                source.store, key, force=force, channel=source.names.notice_channel
            )
            if live and not force:
                words = store_inspect.label(source.store, key)
                named = f"{key} ({words})" if words else key
                held = holders_in_words(live, live_workers(source))
                raise Refused(f"{named} {held}: tick force to free it")
            return f"{key}: {removed} holder(s) removed"
        if action in ("pause", "resume", "trigger"):
            name = form.get("name", "")
            getattr(schedules, action)(name)
            return f"{name}: {action}d" if action != "trigger" else f"{name}: triggered"
    except BatonError as exc:
        raise Refused(str(exc)) from exc
    raise Refused(f"unknown action {action!r} (one of {', '.join(ACTIONS)})")


def _cancel(form: Mapping[str, str], cancel: CancelAction | None) -> str:
    """``task_id``, or ``task`` and ``key`` (JSON); ``terminate``."""
    if cancel is None:
        raise Refused("cancel is not available on this server")
    task_id = form.get("task_id", "").strip() or None
    task = form.get("task", "").strip() or None
    key = None
    text = form.get("key", "").strip()
    if text:
        try:
            key = json.loads(text)
        except ValueError as exc:
            raise Refused(f"the key is not JSON: {exc}") from None
    if (task_id is None) == (task is None and key is None):
        raise Refused("give a task id, or a task and a key")
    return cancel(task_id, task, key, form.get("terminate") in ("1", "on", "true"))
