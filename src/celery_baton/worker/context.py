"""What a running task can ask about its own coordination."""

from __future__ import annotations

from celery import current_task

from celery_baton.errors import NotInExclusiveTask

FENCE_FIELD = "baton_fence"


def fence() -> int:
    """The fencing token of the exclusive lease this run holds.

    It grows with every acquisition of the key, so a store can refuse a late write from
    a run whose lease expired while it was paused::

        UPDATE feeds SET ..., fence = :fence WHERE url = :url AND fence < :fence
    """
    task = current_task
    value = getattr(task.request, FENCE_FIELD, None) if task else None
    if not value:
        raise NotInExclusiveTask("fence() is only available inside a run of an exclusive task")
    return int(value)
