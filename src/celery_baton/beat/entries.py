"""Schedule entries as beat sees them: a Celery entry plus its slot rule and policies.

Policies are read from the entry's ``options`` (they are removed before the message
is published)::

    "options": {
        "baton_misfire": "skip" | "latest" | "all",   # default "skip"
        "baton_misfire_grace": 30.0,                    # seconds; default baton_beat_misfire_grace
        "baton_misfire_max": 100,                       # default baton_beat_misfire_max
        "baton_overlap": "allow" | "skip",             # default "allow"
        "baton_timezone": "Europe/Berlin",              # crontab only; default app.conf.timezone
    }

Entries made by the runtime API are stored as JSON definitions (``def``) and rebuilt
here, so their arguments must be JSON values.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from celery.beat import ScheduleEntry

from celery_baton import internals
from celery_baton.beat.slots import CrontabRule, Policy, SlotRule, fingerprint, rule_for, zone
from celery_baton.config import BEAT_ENTRY_OPTIONS, Settings, suggest
from celery_baton.core.policy import per_call
from celery_baton.errors import BatonError, BeatEntryError

OPTION_PREFIX = "baton_"
#: The ``baton_*`` options an entry may have (see above); ``baton`` is a call's options.
ENTRY_OPTIONS = BEAT_ENTRY_OPTIONS


def check_entry_options(name: str, task: str, options: Mapping[str, Any]) -> None:
    """A ``baton_*`` option we do not have (``baton_misfir``), or one of ours without its
    prefix (``misfire``), is a typo that would leave the entry on the default policy:
    refuse it, every one at once, as task options are refused. The per-call options of
    ``baton={...}`` are checked as a publish checks them."""
    bare = [option[len(OPTION_PREFIX) :] for option in ENTRY_OPTIONS]
    typos = []
    for option in options:
        if not isinstance(option, str) or option in ENTRY_OPTIONS:
            continue
        if option.startswith(OPTION_PREFIX):
            typos.append(f"`{option}`{suggest(option, ENTRY_OPTIONS)}")
        elif option in bare or suggest(option, bare):
            close = option if option in bare else suggest(option, bare).split("`")[1]
            typos.append(f"`{option}` (did you mean `{OPTION_PREFIX}{close}`?)")
    if typos:
        plural = "s" if len(typos) > 1 else ""
        raise BeatEntryError(f"unknown option{plural} {'; '.join(typos)}", entry=name)
    if options.get(per_call.CALL_OPTION) is not None:
        try:
            per_call.parse(task, options[per_call.CALL_OPTION])
        except BatonError as exc:
            raise BeatEntryError(str(exc), entry=name) from exc


@dataclass(frozen=True)
class CompiledEntry:
    """An entry ready to schedule: what it sends, when, and how it treats misfires."""

    name: str
    entry: ScheduleEntry
    rule: SlotRule
    fingerprint: str
    policy: Policy
    source: str  # "config" (beat_schedule) or "api"
    definition: str = ""  # JSON of an API entry

    def fields(self) -> dict[str, str]:
        """What the store keeps about the entry besides its slots (for the listing)."""
        fields = {
            "source": self.source,
            "task": str(self.entry.task),
            "schedule": repr(self.entry.schedule),
            "policy": json.dumps(self.policy.as_dict(), sort_keys=True),
        }
        if self.definition:
            fields["def"] = self.definition
        return fields

    @property
    def send_options(self) -> dict[str, Any]:
        return {k: v for k, v in self.entry.options.items() if not k.startswith(OPTION_PREFIX)}


def task_hint(task: str, registered: Iterable[str]) -> str:
    """`` (did you mean `proj.tasks.tick`?)`` for an entry's task that is not registered:
    a near miss (``proj.tasks.tik``), or the short name a task is often written with in a
    schedule (``"tick"`` or ``"tasks.tick"`` for ``proj.tasks.tick``: Celery names a task
    by its module's full path)."""
    names = list(registered)
    by_suffix = sorted(n for n in names if n.endswith(f".{task}"))
    if by_suffix:
        return " (did you mean " + " or ".join(f"`{n}`" for n in by_suffix) + "?)"
    return suggest(task, names)


def _grace(options: Mapping[str, Any], rule: SlotRule, settings: Settings, app: Any) -> float:
    """An entry's misfire grace: its own ``baton_misfire_grace``; else, for a crontab,
    Celery's ``beat_cron_starting_deadline`` (5.5+) when set, which means the same (a
    missed run older than it is not caught up, a newer one runs once); else the app's
    ``baton_beat_misfire_grace``."""
    if "baton_misfire_grace" in options:
        return float(options["baton_misfire_grace"])
    deadline = app.conf.get("beat_cron_starting_deadline")
    if deadline is not None and isinstance(rule, CrontabRule):
        return float(deadline)
    return settings.beat_misfire_grace


def compile_entry(
    entry: ScheduleEntry,
    *,
    settings: Settings,
    app: Any,
    source: str = "config",
    definition: str = "",
) -> CompiledEntry:
    """Validate ``entry``; raise :class:`BeatEntryError` naming it if it cannot run."""
    name = str(entry.name)
    options = entry.options or {}
    check_entry_options(name, str(entry.task or ""), options)
    try:
        tz_opt = options.get("baton_timezone")
        rule = rule_for(entry.schedule, tz=zone(str(tz_opt)) if tz_opt else None)
        policy = Policy(
            misfire=str(options.get("baton_misfire", "skip")),
            grace=_grace(options, rule, settings, app),
            max_runs=int(options.get("baton_misfire_max", settings.beat_misfire_max)),
            overlap=str(options.get("baton_overlap", "allow")),
        )
    except (ValueError, TypeError) as exc:
        raise BeatEntryError(str(exc), entry=name) from exc
    if not entry.task:
        raise BeatEntryError("names no task", entry=name)
    if settings.beat_check_tasks and entry.task not in app.tasks:
        raise BeatEntryError(
            f"unknown task {entry.task!r}{task_hint(str(entry.task), app.tasks)} (not "
            "registered in this app; set baton_beat_check_tasks = False to send tasks by "
            "name)",
            entry=name,
        )
    return CompiledEntry(
        name=name,
        entry=entry,
        rule=rule,
        fingerprint=fingerprint(rule),
        policy=policy,
        source=source,
        definition=definition,
    )


# -- JSON definitions of runtime-API entries ---------------------------------------


def schedule_to_json(schedule: Any) -> dict[str, Any]:
    """A Celery schedule (or seconds, a timedelta, a cron string) as a JSON value."""
    from celery.schedules import crontab, solar
    from celery.schedules import schedule as interval

    if isinstance(schedule, str):
        parts = schedule.split()
        if len(parts) != 5:
            raise ValueError(f"a cron string has 5 fields, got {schedule!r}")
        minute, hour, dom, month, dow = parts
        return {
            "kind": "crontab",
            "minute": minute,
            "hour": hour,
            "day_of_week": dow,
            "day_of_month": dom,
            "month_of_year": month,
        }
    if isinstance(schedule, int | float) and not isinstance(schedule, bool):
        return {"kind": "interval", "seconds": float(schedule)}
    if isinstance(schedule, timedelta):
        return {"kind": "interval", "seconds": schedule.total_seconds()}
    if isinstance(schedule, crontab):
        fields = internals.crontab_fields(schedule)
        return {"kind": "crontab", **{name: _cronfield(v) for name, v in fields.items()}}
    if isinstance(schedule, interval):
        return {"kind": "interval", "seconds": schedule.run_every.total_seconds()}
    if isinstance(schedule, solar):
        return {"kind": "solar", "event": schedule.event, "lat": schedule.lat, "lon": schedule.lon}
    raise ValueError(f"the runtime API cannot store a {type(schedule).__name__} schedule")


def _cronfield(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, int):
        return str(value)
    if isinstance(value, Iterable):
        return ",".join(str(v) for v in sorted(value))
    return str(value)


def schedule_from_json(data: Mapping[str, Any], app: Any) -> Any:
    from celery.schedules import crontab, solar
    from celery.schedules import schedule as interval

    kind = data.get("kind")
    if kind == "interval":
        return interval(timedelta(seconds=float(data["seconds"])), app=app)
    if kind == "crontab":
        return crontab(
            minute=data["minute"],
            hour=data["hour"],
            day_of_week=data["day_of_week"],
            day_of_month=data["day_of_month"],
            month_of_year=data["month_of_year"],
            app=app,
        )
    if kind == "solar":
        return solar(data["event"], data["lat"], data["lon"], app=app)
    raise ValueError(f"unknown schedule kind {kind!r}")


def entry_from_definition(name: str, definition: str, app: Any) -> ScheduleEntry:
    data = json.loads(definition)
    return ScheduleEntry(
        name=name,
        task=data["task"],
        schedule=schedule_from_json(data["schedule"], app),
        args=tuple(data.get("args") or ()),
        kwargs=dict(data.get("kwargs") or {}),
        options=dict(data.get("options") or {}),
        app=app,
    )


def definition_json(
    task: str,
    schedule: Any,
    args: Iterable[Any],
    kwargs: Mapping[str, Any],
    options: Mapping[str, Any],
) -> str:
    data = {
        "task": task,
        "schedule": schedule_to_json(schedule),
        "args": list(args),
        "kwargs": dict(kwargs),
        "options": dict(options),
    }
    try:
        return json.dumps(data, sort_keys=True)
    except TypeError as exc:
        raise ValueError(f"runtime API entries need JSON arguments and options: {exc}") from exc
