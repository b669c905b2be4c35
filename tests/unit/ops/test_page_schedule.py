"""The web view's schedule: with no beat leading, an entry is not shown ``active`` (its
next run is in the past and nothing fires it; issue 39 §4)."""

from __future__ import annotations

from celery_baton.ops.web.page import _schedule

ENTRY = {"name": "nightly", "task": "t", "schedule": "every 60s", "next_slot": None}


def test_an_entry_with_no_beat_leading_says_so() -> None:
    html = _schedule({"leader": {}, "entries": [dict(ENTRY, trigger_pending=True)]}, actions=False)
    assert "active" not in html
    assert "no beat leads" in html


def test_an_entry_of_a_led_schedule_is_active() -> None:
    led = {"leader": {"owner": "beat-1", "fence": 3}, "entries": [ENTRY]}
    assert "active" in _schedule(led, actions=False)
