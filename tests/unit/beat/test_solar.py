"""Solar entries (celery.schedules.solar, needs ``ephem``): the scheduler asks the schedule
itself for the next instant; its fingerprint says when it fires, nothing else."""

from __future__ import annotations

import time

from celery import Celery
from celery.schedules import solar

from celery_baton.beat.slots import EstimateRule, fingerprint, rule_for


def test_solar_next_slot_is_the_next_sunrise_and_fingerprint_tracks_edits() -> None:
    app = Celery("solar", set_as_current=False)
    sunrise = rule_for(solar("sunrise", 48.85, 2.35, app=app))  # Paris
    assert isinstance(sunrise, EstimateRule)
    now_ms = int(time.time() * 1000)
    first = sunrise.first_after(now_ms)
    assert now_ms < first <= now_ms + 25 * 3600 * 1000  # the next sunrise, within a day
    following = sunrise.following(first)
    assert first < following  # never the same slot twice

    same = rule_for(solar("sunrise", 48.85, 2.35, app=app))
    sunset = rule_for(solar("sunset", 48.85, 2.35, app=app))
    elsewhere = rule_for(solar("sunrise", 40.71, -74.0, app=app))
    assert fingerprint(sunrise) == fingerprint(same)
    assert len({fingerprint(sunrise), fingerprint(sunset), fingerprint(elsewhere)}) == 3
