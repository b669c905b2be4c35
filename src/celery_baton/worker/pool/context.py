"""What a running task can ask about its own coordination."""

from __future__ import annotations

import time
from typing import Any

from celery import current_task

from celery_baton.errors import NotInExclusiveTask

FENCE_FIELD = "baton_fence"


def fence() -> int:
    """The fencing token of the exclusive lease this run holds.

    It grows with every acquisition of the key, so a store can refuse a late write from
    a run whose lease expired while it was paused::

        UPDATE feeds SET ..., fence = :fence WHERE url = :url AND fence < :fence

    Called in a run that no worker admitted (``.apply()``, ``task_always_eager``, or the
    task function called directly in a test) it returns the current time in
    microseconds: it grows like a real token (which is also in microseconds on the
    store's clock), so guarded writes behave in tests as they do in production.
    """
    task = current_task
    value = getattr(task.request, FENCE_FIELD, None) if task else None
    if value:
        return int(value)
    if task is not None and _exclusive(task) and _not_from_a_worker(task.request):
        return time.time_ns() // 1000
    raise NotInExclusiveTask("fence() is only available inside a run of an exclusive task")


def _exclusive(task: Any) -> bool:
    return getattr(task, "exclusive", None) not in (None, False)


def _not_from_a_worker(request: Any) -> bool:
    # Eager runs (.apply(), task_always_eager) are marked is_eager; a direct call of the
    # task object has no delivery at all.
    return (
        bool(getattr(request, "is_eager", False)) or getattr(request, "delivery_info", None) is None
    )
