"""``baton schedule history``: how a missed line reads (ops/cli/schedule.py)."""

from __future__ import annotations

from celery_baton.ops.cli.schedule import _kind


def test_a_missed_line_shows_its_count_and_the_run_it_was_coalesced_into() -> None:
    line = {
        "kind": "missed",
        "count": 5,
        "first": "2026-06-01T10:00:00.000Z",
        "last": "2026-06-01T10:00:04.000Z",
        "coalesced": True,
        "into": "2026-06-01T10:00:05.000Z",
    }
    assert _kind(line) == "missed 5 (to 10:00:04.000), coalesced into 10:00:05.000"
    held = {**line, "count": 1, "last": line["first"], "at_worker": True}
    assert _kind(held) == "missed 1, coalesced into 10:00:05.000 (held at a worker)"
    assert _kind({"kind": "missed", "count": 3}) == "missed 3"
    assert _kind({"kind": "fired"}) == "fired"
