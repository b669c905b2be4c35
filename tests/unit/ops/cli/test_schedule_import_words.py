"""``baton schedule import --from-redbeat``: what it prints (ops/cli/schedule.py)."""

from __future__ import annotations

from celery_baton.beat.redbeat_import import ImportReport
from celery_baton.ops.cli.schedule import import_lines


def test_nothing_found_says_where_it_looked_without_the_password() -> None:
    lines = import_lines(ImportReport(), "redis://:secret@10.0.0.6:6379/0", "redbeat:")
    assert lines == [
        "imported: nothing (no redbeat entry under redbeat:* at redis://:***@10.0.0.6:6379/0;"
        " --redbeat-url and --prefix name another place)"
    ]


def test_entries_found_are_listed_as_before() -> None:
    report = ImportReport(imported=["every10", "off"], paused=["off"], skipped={"r": "why"})
    assert import_lines(report, "redis://h/1", "redbeat:") == [
        "imported: every10, off",
        "paused (disabled in redbeat): off",
        "skipped r: why",
    ]
    only_skipped = ImportReport(skipped={"every10": "already in the schedule (use --replace)"})
    assert import_lines(only_skipped, "redis://h/1", "redbeat:")[0] == "imported: nothing"
