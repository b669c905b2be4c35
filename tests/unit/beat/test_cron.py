"""Cron next-slot computation against a brute-force minute walk and croniter.

Rule under test (celery_baton.beat.cron): each matching *wall-clock* minute of the
zone fires once; a minute inside a spring-forward gap fires at the gap's end; a
minute of a repeated (fall-back) hour fires at its first occurrence only.
"""

from __future__ import annotations

import functools
import itertools
from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest
from croniter import croniter

from celery_baton.beat.cron import CronRule, wall_to_instant

UTC = timezone.utc
ZONES = ["America/New_York", "Europe/Berlin", "Australia/Sydney", "Asia/Kolkata"]
START = datetime(2026, 1, 1, tzinfo=UTC)
END = datetime(2027, 1, 1, tzinfo=UTC)

# (cron string for croniter, CronRule fields); day_of_week 0 = Sunday in both.
SPECS = {
    "30 2 * * *": dict(minute={30}, hour={2}),  # inside the US/EU spring gap
    "0 2 * * *": dict(minute={0}, hour={2}),  # first minute of the gap / repeat
    "*/15 1-3 * * *": dict(minute={0, 15, 30, 45}, hour={1, 2, 3}),
    "45 1 * * 0": dict(minute={45}, hour={1}, day_of_week={0}),  # Sundays, repeat hour
    "0 9 1-7 * 1": dict(minute={0}, hour={9}, day_of_month=set(range(1, 8)), day_of_week={1}),
    "10 0 31 * *": dict(minute={10}, hour={0}, day_of_month={31}),
    "5 3 * 3,4,10 *": dict(minute={5}, hour={3}, month_of_year={3, 4, 10}),
}


@functools.cache
def walls(zone: str) -> list[tuple[datetime, datetime, int]]:
    """Every UTC minute of the year with its local wall time (naive) and fold."""
    tz = ZoneInfo(zone)
    out = []
    t = START - timedelta(minutes=1)
    while t < END:
        local = t.astimezone(tz)
        out.append((t, local.replace(tzinfo=None), local.fold))
        t += timedelta(minutes=1)
    return out


def brute_force(rule: CronRule, zone: str) -> list[datetime]:
    """Walk minute by minute: fire at a UTC minute whose wall minute matches (first
    occurrence only), or that ends a gap containing a matching wall minute."""
    fired = []
    rows = walls(zone)
    for (_, prev_wall, _), (t, wall, fold) in itertools.pairwise(rows):
        if fold == 0 and rule.matches_wall(wall):
            fired.append(t)
            continue
        skipped = prev_wall + timedelta(minutes=1)
        while skipped < wall and fold == 0:  # a gap: wall minutes that never happen
            if rule.matches_wall(skipped):
                fired.append(t)
                break
            skipped += timedelta(minutes=1)
    return fired


def ours(rule: CronRule) -> list[datetime]:
    fired = []
    t = START - timedelta(seconds=1)
    while True:
        t = rule.next_after(t)
        if t >= END:
            return fired
        fired.append(t)


def oracle(spec: str, zone: str) -> list[datetime]:
    """croniter, minus second occurrences of repeated wall times (our rule: once)."""
    tz = ZoneInfo(zone)
    it = croniter(spec, (START - timedelta(seconds=1)).astimezone(tz), day_or=False)
    fired: list[datetime] = []
    while True:
        t = it.get_next(datetime)
        if t >= END:
            break
        wall = t.replace(tzinfo=None)
        if t.fold == 1 and wall_to_instant(wall, tz) < t.astimezone(UTC):
            continue  # croniter's second pass over a repeated hour
        utc = t.astimezone(UTC)
        if not fired or fired[-1] != utc:
            fired.append(utc)
    return fired


@pytest.mark.parametrize("zone", ZONES)
@pytest.mark.parametrize("spec", list(SPECS))
def test_year_matches_brute_force_and_croniter(zone: str, spec: str) -> None:
    rule = CronRule.build(tz=ZoneInfo(zone), **SPECS[spec])  # type: ignore[arg-type]
    mine = ours(rule)
    assert mine == brute_force(rule, zone)
    assert mine == oracle(spec, zone)
    assert len(mine) == len(set(mine))


def test_every_minute_over_a_year_in_new_york() -> None:
    zone = "America/New_York"
    rule = CronRule.build(tz=ZoneInfo(zone))
    mine = ours(rule)
    assert mine == brute_force(rule, zone)
    # 365 days of minutes, minus the repeated hour's second pass; the gap costs nothing
    # in real minutes (it is wall time that jumps).
    assert len(mine) == 365 * 24 * 60 - 60


NY = ZoneInfo("America/New_York")
BERLIN = ZoneInfo("Europe/Berlin")


def test_gap_fires_once_at_the_first_valid_instant() -> None:
    rule = CronRule.build(minute={0, 15, 30, 45}, hour={2}, tz=NY)
    # 2026-03-08 02:00-03:00 does not exist in New York.
    fired = []
    t = datetime(2026, 3, 8, 0, 0, tzinfo=NY)
    for _ in range(3):
        t = rule.next_after(t)
        fired.append(t.astimezone(NY))
    assert fired[0] == datetime(2026, 3, 8, 3, 0, tzinfo=NY)
    assert fired[1] == datetime(2026, 3, 9, 2, 0, tzinfo=NY)


def test_repeated_hour_fires_once() -> None:
    rule = CronRule.build(minute={30}, hour={2}, tz=BERLIN)
    # 2026-10-25 02:00-03:00 happens twice in Berlin.
    first = rule.next_after(datetime(2026, 10, 24, 12, tzinfo=UTC))
    assert first == datetime(2026, 10, 25, 0, 30, tzinfo=UTC)  # 02:30 CEST
    assert rule.next_after(first) == datetime(2026, 10, 26, 1, 30, tzinfo=UTC)


def test_bad_fields_are_refused() -> None:
    with pytest.raises(ValueError, match="minute"):
        CronRule.build(minute={61})
    with pytest.raises(ValueError, match="never fires"):
        CronRule.build(day_of_month={31}, month_of_year={2}).next_after(START)
