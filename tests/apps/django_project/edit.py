"""Edits of django-celery-beat's rows as the admin makes them (a model ``save()``, which
bumps ``PeriodicTasks.last_update``), run in a process of its own::

    python -m tests.apps.django_project.edit '[{"name": "a", "every": 2}, ...]'

Each change: ``name``; one of ``every`` (seconds), ``cron`` ({"minute", "hour"}, UTC),
``clocked`` (epoch ms); ``fields`` (other columns; ``*_time``, ``expires`` as epoch ms);
``delete``. Prints every row afterwards as JSON (datetimes as epoch ms).
"""

from __future__ import annotations

import json
import os
import sys
from datetime import datetime, timezone
from typing import Any

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.apps.django_project.settings")

import django

django.setup()

from django_celery_beat.models import (  # noqa: E402
    ClockedSchedule,
    CrontabSchedule,
    IntervalSchedule,
    PeriodicTask,
)

RECORD = "tests.apps.django_project.celery_app.record"
TIMES = ("start_time", "expires", "last_run_at")


def _time(ms: int | None) -> datetime | None:
    return None if ms is None else datetime.fromtimestamp(ms / 1000, timezone.utc)


def _ms(value: datetime | None) -> int | None:
    return None if value is None else round(value.timestamp() * 1000)


def apply(change: dict[str, Any]) -> None:
    name = change["name"]
    if change.get("delete"):
        PeriodicTask.objects.filter(name=name).delete()
        return
    row = PeriodicTask.objects.filter(name=name).first()
    if row is None:
        row = PeriodicTask(name=name, task=RECORD, args=json.dumps([name]))
    if "every" in change:
        row.interval, _ = IntervalSchedule.objects.get_or_create(
            every=change["every"], period=IntervalSchedule.SECONDS
        )
        row.crontab = row.clocked = None
    if "cron" in change:
        row.crontab, _ = CrontabSchedule.objects.get_or_create(
            minute=str(change["cron"]["minute"]),
            hour=str(change["cron"].get("hour", "*")),
            day_of_week="*",
            day_of_month="*",
            month_of_year="*",
            timezone="UTC",
        )
        row.interval = row.clocked = None
    if "clocked" in change:
        row.clocked = ClockedSchedule.objects.create(clocked_time=_time(change["clocked"]))
        row.interval = row.crontab = None
        row.one_off = True
    for column, value in change.get("fields", {}).items():
        setattr(row, column, _time(value) if column in TIMES else value)
    row.save()


def rows() -> dict[str, dict[str, Any]]:
    return {
        row.name: {
            "enabled": row.enabled,
            "one_off": row.one_off,
            "total_run_count": row.total_run_count,
            "last_run_at": _ms(row.last_run_at),
        }
        for row in PeriodicTask.objects.all()
    }


if __name__ == "__main__":
    for change in json.loads(sys.argv[1] if len(sys.argv) > 1 else "[]"):
        apply(change)
    print(json.dumps(rows()))
