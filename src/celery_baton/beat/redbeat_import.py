"""Import celery-redbeat's entries into the store, so a user moves without retyping them.

celery-redbeat keeps each entry in a hash ``<prefix><name>`` (``redbeat:`` by default)
whose ``definition`` field is JSON: ``name``, ``task``, ``args``, ``kwargs``,
``options``, ``enabled`` and ``schedule``, a tagged object (``{"__type__": "interval",
"every": seconds}`` or ``{"__type__": "crontab", "minute": ..., ...}``). This module reads
that format itself (no redbeat import), and adds each entry through the runtime API,
so it is validated like any other (a task this app does not know is refused).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from celery.schedules import crontab

from celery_baton.beat.api import ScheduleStore
from celery_baton.errors import BatonError


@dataclass
class ImportReport:
    imported: list[str] = field(default_factory=list)
    paused: list[str] = field(default_factory=list)  # disabled in redbeat: kept paused
    skipped: dict[str, str] = field(default_factory=dict)  # name -> why


def redbeat_schedule(spec: Any) -> Any:
    """A redbeat schedule object as one ScheduleStore accepts; ValueError otherwise."""
    kind = spec.get("__type__") if isinstance(spec, dict) else None
    if kind == "interval":
        return float(spec["every"])
    if kind == "crontab":
        return crontab(
            minute=spec.get("minute", "*"),
            hour=spec.get("hour", "*"),
            day_of_week=spec.get("day_of_week", "*"),
            day_of_month=spec.get("day_of_month", "*"),
            month_of_year=spec.get("month_of_year", "*"),
        )
    raise ValueError(f"schedule type {kind!r} cannot be imported (interval and crontab can)")


def import_redbeat(
    client: Any, schedules: ScheduleStore, *, prefix: str = "redbeat:", replace: bool = False
) -> ImportReport:
    """Add every redbeat entry found under ``prefix`` (``client``: a redis client of the
    store redbeat used). An entry that already exists is skipped unless ``replace``."""
    report = ImportReport()
    existing = {e["name"] for e in schedules.describe().get("entries", [])}
    for key in sorted(client.scan_iter(match=f"{prefix}*", count=1000)):
        key = key.decode() if isinstance(key, bytes) else key
        if client.type(key) not in ("hash", b"hash"):
            continue  # redbeat's own bookkeeping (:schedule, :statics, :lock)
        raw = client.hget(key, "definition")
        if not raw:
            continue
        name = key[len(prefix) :]
        try:
            definition = json.loads(raw)
            name = str(definition.get("name") or name)
            schedule = redbeat_schedule(definition.get("schedule"))
            if name in existing:
                if not replace:
                    report.skipped[name] = "already in the schedule (use --replace)"
                    continue
                schedules.remove(name)
            schedules.add(
                name,
                str(definition["task"]),
                schedule,
                args=definition.get("args") or (),
                kwargs=definition.get("kwargs") or {},
                options=definition.get("options") or {},
            )
        except (BatonError, ValueError, KeyError, TypeError) as exc:
            report.skipped[name] = str(exc)
            continue
        report.imported.append(name)
        if definition.get("enabled") is False:
            schedules.pause(name)
            report.paused.append(name)
    return report
