"""CLI tables fit the terminal and never cut a time or a key (issue 28 §3)."""

from __future__ import annotations

import pytest

from celery_baton.ops.cli.output import table

TIME = "2026-11-27T03:59:13"
TASK_ID = "9ddb7462-1ac3-48d7-822a-13b41934a95f"


def test_a_wide_terminal_shows_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    text = table([(TIME, "fired", TASK_ID, TIME, "SUCCESS" * 5)], ["a", "b", "c", "d", "e"])
    assert TIME in text and TASK_ID in text and "SUCCESS" * 5 in text, text
    assert "…" not in text


def test_a_narrow_terminal_cuts_the_other_columns_never_the_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    text = table(
        [(TIME, "fired", TASK_ID, TIME, "a long outcome " * 4)],
        ["slot", "kind", "task id", "sent at", "outcome"],
        keep=(0, 2, 3),
    )
    assert text.count(TIME) == 2 and TASK_ID in text, text
    assert all(len(line) <= 100 for line in text.splitlines()), text
    assert "…" in text


def test_a_time_is_never_cut_even_when_not_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "40")
    text = table([(TIME, "-", "x" * 80)], ["when", "also", "text"])
    assert TIME in text, text


def test_a_column_is_never_cut_below_its_header(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: at 80 columns ``baton schedule`` printed ``fired /…`` and ``skip/al…``
    while its line still wrapped on the task id it keeps."""
    monkeypatch.setenv("COLUMNS", "80")
    text = table(
        [("nightly-report", TIME, "3 / 1", "skip/allow", TASK_ID)],
        ["entry", "last fired", "fired / missed", "skip/allow", "task id"],
        keep=(4,),
    )
    header = text.splitlines()[0]
    assert "fired / missed" in header and "skip/allow" in header, text
    assert "3 / 1" in text and TASK_ID in text, text


def test_nothing_is_cut_when_stdout_is_not_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: cut to 80 columns on a pipe too (``baton schedule | cat``: ``skip/al…``)."""
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setattr("sys.stdout.isatty", lambda: False)
    text = table([("x" * 60, "y" * 60, "z" * 60)], ["a", "b", "c"])
    assert "…" not in text and "x" * 60 in text and "z" * 60 in text, text
