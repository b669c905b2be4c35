"""Next fire instant of a cron rule, in a time zone, with a defined rule for DST.

Celery's ``crontab.remaining_estimate`` works on naive wall-clock arithmetic and can
fire twice in a repeated hour or skip a day around a transition. Here a rule matches
*wall-clock minutes* of its zone, and each matching wall minute fires once:

* a wall minute that does not exist (the spring-forward gap) fires at the first valid
  instant after the gap; several such minutes collapse into that one instant, and so
  does the first wall minute after the gap if it matches too;
* a wall minute that exists twice (the fall-back repeat) fires at its first
  occurrence only.

Day matching follows Celery's ``crontab``: a day must match day-of-month AND
day-of-week AND month (not cron(8)'s OR of the two day fields). Days of the week are
0-6 with Sunday 0.

Celery-free; pure functions over aware datetimes.

>>> from zoneinfo import ZoneInfo
>>> rule = CronRule.build(minute={30}, hour={10}, tz=ZoneInfo("Europe/Berlin"))
>>> rule.next_after(datetime(2026, 3, 1, 9, 0, tzinfo=timezone.utc)).isoformat()
'2026-03-01T09:30:00+00:00'
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import date, datetime, timedelta, timezone, tzinfo

UTC = timezone.utc
_MINUTE = timedelta(minutes=1)
# A rule such as "Feb 29 and a Monday" can be 28 years apart; past this we give up.
_MAX_DAYS = 366 * 30


@dataclass(frozen=True)
class CronRule:
    """Sets of matching minutes (0-59), hours (0-23), days of week (0-6, Sunday 0),
    days of month (1-31) and months (1-12), evaluated on the wall clock of ``tz``."""

    minutes: tuple[int, ...]
    hours: tuple[int, ...]
    days_of_week: frozenset[int]
    days_of_month: frozenset[int]
    months: frozenset[int]
    tz: tzinfo

    @classmethod
    def build(
        cls,
        *,
        minute: Iterable[int] = range(60),
        hour: Iterable[int] = range(24),
        day_of_week: Iterable[int] = range(7),
        day_of_month: Iterable[int] = range(1, 32),
        month_of_year: Iterable[int] = range(1, 13),
        tz: tzinfo = UTC,
    ) -> CronRule:
        rule = cls(
            minutes=tuple(sorted(set(minute))),
            hours=tuple(sorted(set(hour))),
            days_of_week=frozenset(day_of_week),
            days_of_month=frozenset(day_of_month),
            months=frozenset(month_of_year),
            tz=tz,
        )
        rule.validate()
        return rule

    def validate(self) -> None:
        """Raise ``ValueError`` for a field out of range or a rule that never fires."""
        checks = (
            ("minute", self.minutes, 0, 59),
            ("hour", self.hours, 0, 23),
            ("day_of_week", self.days_of_week, 0, 6),
            ("day_of_month", self.days_of_month, 1, 31),
            ("month_of_year", self.months, 1, 12),
        )
        for name, values, low, high in checks:
            if not values:
                raise ValueError(f"crontab field {name} matches nothing")
            bad = [v for v in values if not low <= v <= high]
            if bad:
                raise ValueError(f"crontab field {name} out of range {low}-{high}: {bad}")

    def matches_day(self, day: date) -> bool:
        return (
            day.month in self.months
            and day.day in self.days_of_month
            and (day.weekday() + 1) % 7 in self.days_of_week
        )

    def matches_wall(self, wall: datetime) -> bool:
        """Whether the naive wall-clock minute ``wall`` matches the rule."""
        return wall.minute in self.minutes and wall.hour in self.hours and self.matches_day(wall)

    def next_wall_after(self, wall: datetime) -> datetime:
        """The first matching naive wall minute strictly after naive ``wall``."""
        start = wall.replace(second=0, microsecond=0) + _MINUTE
        day = start.date()
        for offset in range(_MAX_DAYS):
            if self.matches_day(day):
                found = self._first_time_on(day, start if offset == 0 else None)
                if found is not None:
                    return found
            day += timedelta(days=1)
            if offset == 0:
                start = datetime.combine(day, datetime.min.time())
        raise ValueError(f"crontab never fires within {_MAX_DAYS} days")

    def _first_time_on(self, day: date, not_before: datetime | None) -> datetime | None:
        first_hour = not_before.hour if not_before else 0
        for hour in self.hours[bisect.bisect_left(self.hours, first_hour) :]:
            first_minute = not_before.minute if not_before and hour == not_before.hour else 0
            i = bisect.bisect_left(self.minutes, first_minute)
            if i < len(self.minutes):
                return datetime(day.year, day.month, day.day, hour, self.minutes[i])
        return None

    def next_after(self, after: datetime) -> datetime:
        """The first fire instant strictly after aware ``after``, as an aware UTC datetime."""
        if after.tzinfo is None:
            raise ValueError("next_after needs an aware datetime")
        wall = after.astimezone(self.tz).replace(tzinfo=None)
        while True:
            wall = self.next_wall_after(wall)
            instant = wall_to_instant(wall, self.tz)
            # In the second pass of a repeated hour, a wall minute whose first
            # occurrence is already past has fired: keep looking.
            if instant > after:
                return instant


def wall_to_instant(wall: datetime, tz: tzinfo) -> datetime:
    """Naive wall time in ``tz`` -> the UTC instant it fires at.

    Unique: that instant. Repeated: the first occurrence. Missing (in a gap): the
    instant the gap ends, i.e. the first valid instant after it.
    """
    first = wall.replace(tzinfo=tz, fold=0).astimezone(UTC)
    second = wall.replace(tzinfo=tz, fold=1).astimezone(UTC)
    if first <= second:
        # Unique (equal) or repeated (first < second): the earlier one.
        return first
    # A gap: fold=0 reads the wall time with the offset before the jump, fold=1 with
    # the offset after, so the jump lies in (second, first]. Transitions fall on whole
    # seconds: bisect over integer seconds for the first one with the new offset.
    low, high = int(second.timestamp()), int(first.timestamp())
    before = _offset(low, tz)
    while high - low > 1:
        mid = (low + high) // 2
        if _offset(mid, tz) == before:
            low = mid
        else:
            high = mid
    return datetime.fromtimestamp(high, UTC)


def _offset(epoch: int, tz: tzinfo) -> timedelta | None:
    return datetime.fromtimestamp(epoch, UTC).astimezone(tz).utcoffset()


def _round_trips(instant: datetime, wall: datetime, tz: tzinfo) -> bool:
    return instant.astimezone(tz).replace(tzinfo=None) == wall


def is_gap(wall: datetime, tz: tzinfo) -> bool:
    """Whether the naive wall time does not exist in ``tz``."""
    return not _round_trips(wall.replace(tzinfo=tz).astimezone(UTC), wall, tz)
