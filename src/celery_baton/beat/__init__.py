"""The beat scheduler: ``celery beat -S celery_baton.beat:Scheduler``.

See docs/beat.md. ``Scheduler`` is Celery's scheduler interface; ``ScheduleStore`` is
the runtime API; ``describe_schedule`` is what ``celery baton schedule`` prints.
"""

from celery_baton.beat.api import ScheduleStore, describe_schedule
from celery_baton.beat.scheduler import Scheduler, slot_task_id

__all__ = ["ScheduleStore", "Scheduler", "describe_schedule", "slot_task_id"]
