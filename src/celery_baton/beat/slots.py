"""Slots: the scheduled instants of an entry, as integer epoch milliseconds (UTC).

A :class:`SlotRule` turns Celery's schedule objects (``schedule``/numbers/timedelta,
``crontab``, ``solar``) into "the next slot after t". Its :attr:`~SlotRule.fingerprint`
hashes only *when* the entry fires (interval, cron fields + time zone, solar args):
changing it is an edit, after which the next slot is computed from now. Changing the
task, its arguments or options is not an edit: it applies from the next slot on and
does not move it.

:func:`plan_due` decides, for an entry whose stored next slot has come, which slots
fire, which are recorded as missed (misfire policy), and what the next slot becomes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone, tzinfo
from typing import Any, Protocol
from zoneinfo import ZoneInfo

from celery_baton.beat.cron import CronRule

UTC = timezone.utc
MISFIRE_POLICIES = ("skip", "latest", "all")
OVERLAP_POLICIES = ("allow", "skip")
# Enumerating missed slots stops here (a 1 s entry down for a day has 86,400);
# beyond it the entry jumps to its first slot after now and the count is estimated.
ENUMERATE_LIMIT = 10_000


def to_ms(dt: datetime) -> int:
    return round(dt.timestamp() * 1000)


def from_ms(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, UTC)


class SlotRule(Protocol):
    """When an entry fires."""

    @property
    def definition(self) -> dict[str, Any]:
        """JSON-able definition of *when* the entry fires; its hash is the fingerprint."""

    def following(self, slot_ms: int) -> int:
        """The slot after ``slot_ms`` in the same series."""

    def first_after(self, now_ms: int) -> int:
        """The first slot strictly after ``now_ms`` for a new or edited entry."""

    def skip_to(self, slot_ms: int, now_ms: int) -> int:
        """The first slot of ``slot_ms``'s series strictly after ``now_ms``."""


def fingerprint(rule: SlotRule) -> str:
    raw = json.dumps(rule.definition, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(raw.encode()).hexdigest()[:20]


@dataclass(frozen=True)
class IntervalRule:
    """Every ``seconds``, anchored on the entry's first slot (no drift)."""

    ms: int
    definition: dict[str, Any] = field(init=False, compare=False)

    def __post_init__(self) -> None:
        if self.ms <= 0:
            raise ValueError(f"interval must be > 0 s, got {self.ms / 1000:g} s")
        object.__setattr__(self, "definition", {"kind": "interval", "ms": self.ms})

    def following(self, slot_ms: int) -> int:
        return slot_ms + self.ms

    def first_after(self, now_ms: int) -> int:
        return now_ms + self.ms

    def skip_to(self, slot_ms: int, now_ms: int) -> int:
        if slot_ms > now_ms:
            return slot_ms
        return slot_ms + ((now_ms - slot_ms) // self.ms + 1) * self.ms


@dataclass(frozen=True)
class CrontabRule:
    """A :class:`CronRule` in its zone; slots are whole minutes (or a DST gap's end)."""

    cron: CronRule
    definition: dict[str, Any] = field(init=False, compare=False)

    def __post_init__(self) -> None:
        c = self.cron
        object.__setattr__(
            self,
            "definition",
            {
                "kind": "crontab",
                "minute": list(c.minutes),
                "hour": list(c.hours),
                "day_of_week": sorted(c.days_of_week),
                "day_of_month": sorted(c.days_of_month),
                "month_of_year": sorted(c.months),
                "tz": tz_name(c.tz),
            },
        )

    def following(self, slot_ms: int) -> int:
        return to_ms(self.cron.next_after(from_ms(slot_ms)))

    def first_after(self, now_ms: int) -> int:
        return self.following(now_ms)

    def skip_to(self, slot_ms: int, now_ms: int) -> int:
        return self.following(now_ms) if slot_ms <= now_ms else slot_ms


@dataclass(frozen=True)
class EstimateRule:
    """Any other schedule object (``solar``, user classes): asks the schedule itself.

    ``remaining_estimate(last_run_at)`` counts from the schedule's own ``now()``, so
    ``now() + remaining_estimate(t)`` is the instant it is due after a run at ``t``.
    """

    schedule: Any
    definition: dict[str, Any]

    def _due_after(self, t_ms: int) -> int:
        now = self.schedule.now()
        if now.tzinfo is None:
            now = now.replace(tzinfo=UTC)
        remaining = self.schedule.remaining_estimate(from_ms(t_ms))
        due = to_ms(now + remaining)
        # Some estimates are relative to resolution; never hand back a slot <= t.
        return max(due, t_ms + 1000)

    def following(self, slot_ms: int) -> int:
        return self._due_after(slot_ms)

    def first_after(self, now_ms: int) -> int:
        return self._due_after(now_ms)

    def skip_to(self, slot_ms: int, now_ms: int) -> int:
        return self._due_after(now_ms) if slot_ms <= now_ms else slot_ms


def tz_name(tz: tzinfo) -> str:
    key = getattr(tz, "key", None)
    return str(key) if key else str(tz)


def rule_for(schedule: Any, *, tz: tzinfo | None = None) -> SlotRule:
    """The :class:`SlotRule` of a Celery schedule object (after ``maybe_schedule``).

    ``tz`` overrides a crontab's zone (the ``baton_timezone`` entry option); otherwise
    it is the zone of ``nowfun()`` when that returns an aware datetime, else the
    schedule's app time zone. Raises ``ValueError`` for a schedule that cannot fire.
    """
    from celery.schedules import crontab, solar
    from celery.schedules import schedule as interval

    if isinstance(schedule, crontab):
        zone = tz or _nowfun_zone(schedule) or schedule.tz
        return CrontabRule(
            CronRule.build(
                minute=schedule.minute,
                hour=schedule.hour,
                day_of_week=schedule.day_of_week,
                day_of_month=schedule.day_of_month,
                month_of_year=schedule.month_of_year,
                tz=zone,
            )
        )
    if isinstance(schedule, interval):
        return IntervalRule(round(schedule.run_every.total_seconds() * 1000))
    if isinstance(schedule, solar):
        definition = {
            "kind": "solar",
            "event": schedule.event,
            "lat": schedule.lat,
            "lon": schedule.lon,
        }
        return EstimateRule(schedule, definition)
    kind = f"{type(schedule).__module__}.{type(schedule).__qualname__}"
    return EstimateRule(schedule, {"kind": kind, "repr": repr(schedule)})


def _nowfun_zone(schedule: Any) -> tzinfo | None:
    nowfun: Callable[[], datetime] | None = getattr(schedule, "nowfun", None)
    if nowfun is None:
        return None
    now = nowfun()
    return now.tzinfo if isinstance(now, datetime) and now.tzinfo is not None else None


def zone(name: str) -> tzinfo:
    """``ZoneInfo(name)`` with a ``ValueError`` that names the bad zone."""
    try:
        return ZoneInfo(name)
    except Exception as exc:
        raise ValueError(f"unknown time zone {name!r}") from exc


# -- policies ------------------------------------------------------------------------


@dataclass(frozen=True)
class Policy:
    """Per-entry policies, from the entry's ``options`` (``baton_*`` keys)."""

    misfire: str = "skip"
    grace: float = 30.0
    max_runs: int = 100
    overlap: str = "allow"

    def __post_init__(self) -> None:
        if self.misfire not in MISFIRE_POLICIES:
            raise ValueError(
                f"baton_misfire must be one of {MISFIRE_POLICIES}, got {self.misfire!r}"
            )
        if self.overlap not in OVERLAP_POLICIES:
            raise ValueError(
                f"baton_overlap must be one of {OVERLAP_POLICIES}, got {self.overlap!r}"
            )
        if self.grace < 0:
            raise ValueError("baton_misfire_grace must be >= 0")
        if self.max_runs < 1:
            raise ValueError("baton_misfire_max must be >= 1")

    def as_dict(self) -> dict[str, Any]:
        return {
            "misfire": self.misfire,
            "grace": self.grace,
            "max": self.max_runs,
            "overlap": self.overlap,
        }


@dataclass(frozen=True)
class DuePlan:
    """What to do with an entry whose next slot has come."""

    fire: list[int]
    missed: list[int]
    #: how many more missed slots there were than ``missed`` lists (enumeration cut)
    missed_beyond: int
    next_slot: int
    #: whether the missed slots were coalesced into the one that fires (the late slots
    #: of one entry run once), rather than dropped (past the grace, or ``max_runs``)
    coalesced: bool = False


def plan_due(rule: SlotRule, next_slot: int, now_ms: int, policy: Policy) -> DuePlan:
    """Split the slots in ``[next_slot, now_ms]`` into fired and missed.

    When several slots of one entry are due at once (a leader failover, a beat or store
    outage), they are late: as Celery's own beat, the entry runs once for them, and the
    others are recorded as missed. A slot at most ``policy.grace`` seconds old is on
    time: ``skip`` and ``latest`` fire the newest on-time slot; ``latest`` fires the
    newest late one when none is on time; ``skip`` then fires none. ``all`` fires every
    slot, the newest ``policy.max_runs`` (a catch-up); the rest are missed.
    """
    slots: list[int] = []
    slot = next_slot
    while slot <= now_ms and len(slots) < ENUMERATE_LIMIT:
        slots.append(slot)
        slot = rule.following(slot)
    beyond = 0
    if slot <= now_ms:
        following = rule.skip_to(slot, now_ms)
        # Intervals count exactly; other rules have at least one more (not enumerated).
        beyond = (following - slot) // rule.ms if isinstance(rule, IntervalRule) else 1
        slot = following
    grace_ms = int(policy.grace * 1000)
    on_time = [s for s in slots if now_ms - s <= grace_ms]
    late = [s for s in slots if now_ms - s > grace_ms]
    if policy.misfire == "all":
        fire = (late + on_time)[-policy.max_runs :]
    elif on_time:
        fire = on_time[-1:]
    elif policy.misfire == "latest":
        fire = late[-1:]
    else:
        fire = []
    fired = set(fire)
    missed = [s for s in slots if s not in fired]
    coalesced = bool(fire) and policy.misfire != "all" and bool(missed or beyond)
    return DuePlan(
        fire=fire, missed=missed, missed_beyond=beyond, next_slot=slot, coalesced=coalesced
    )
