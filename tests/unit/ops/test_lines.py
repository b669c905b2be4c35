"""Ordered keys and batch keys as the operator reads them (issues 37 and 38 §1): the read
model's entries from the store's lines, `baton locks`' text and the web page's rows."""

from __future__ import annotations

from typing import Any

import pytest

from celery_baton.core.batch import BatchPolicy
from celery_baton.core.keys import KeySpec, task_words
from celery_baton.ops.cli.locks import batch_text, ordered_text
from celery_baton.ops.state import batch_entry, gap_words, ordered_entry
from celery_baton.ops.web.page import _batches, _ordered
from celery_baton.store.inspect import BatchLine, BatchRun, OrderedLine, _batch_run

KEY = "baton:{proj.apply_event}:ord:5e1f"
LIVE = {"w1@docs"}


def line(**kw: Any) -> OrderedLine:
    fields: dict[str, Any] = {
        "key": KEY,
        "task": "proj.apply_event",
        "next": 14,
        "last": 17,
        "skipped": 0,
        "last_skip": "",
        "gap_clock": 12.0,
        "material": '{"account_id":7}',
    }
    return OrderedLine(**{**fields, **kw})


def test_a_running_call_is_its_lease_holder_and_nothing_is_skipped() -> None:
    entry = ordered_entry(
        line(task_id="t-14", worker="w1@docs", ttl_left=8.25, gap_clock=-8.0, held=3), 60, LIVE
    )
    assert entry["kind"] == "ordered" and entry["label"] == "apply_event(account_id=7)"
    assert (entry["next"], entry["queued"], entry["waiting"], entry["held"]) == (14, 3, 4, 3)
    assert entry["running"] == {
        "task_id": "t-14",
        "worker": "w1@docs",
        "ttl_left": 8.25,
        "stale": False,
    }
    assert entry["skip_in"] is None and entry["idle"] == 0
    text = ordered_text(entry)
    assert text == [
        KEY,
        "    apply_event(account_id=7)",
        "    ordered  next 14  queued 3 (3 held in workers)",
        "    running  task t-14  ttl 8.2s",
        "    on w1@docs",
    ]


def test_a_holder_that_stopped_reporting_is_stale() -> None:
    entry = ordered_entry(line(task_id="t", worker="w9@gone", ttl_left=1.0), 60, LIVE)
    assert entry["running"]["stale"] is True
    assert ordered_text(entry)[-1] == "    on w9@gone  STALE: stopped reporting"


def test_a_missing_next_call_is_skipped_when_its_gap_clock_reaches_the_bound() -> None:
    entry = ordered_entry(line(gap_clock=12.0), 60, LIVE)
    assert entry["running"] is None and entry["skip_in"] == 48.0
    assert ordered_text(entry)[-1] == (
        "    next 14 not started for 12.0s: skipped in 48.0s if its call does not come"
    )
    overdue = ordered_entry(line(gap_clock=75.0), 60, LIVE)
    assert overdue["skip_in"] == 0
    assert "past the gap bound (60s): the next ask skips it" in gap_words(overdue)
    # A retry not yet due: its clock has not started, the bound counts from then.
    assert ordered_entry(line(gap_clock=-5.0), 60, LIVE)["skip_in"] == 65.0


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"next_held": True}, "waits in a worker (never skipped while it asks)"),
        ({"last": 14}, "not started yet (nothing queued behind it)"),
    ],
)
def test_nothing_is_skipped_while_next_waits_in_a_worker_or_nothing_waits_for_it(
    kw: dict[str, Any], words: str
) -> None:
    entry = ordered_entry(line(**kw), 60, LIVE)
    assert entry["skip_in"] is None and gap_words(entry) == words


def test_a_line_an_unstamped_call_started_has_its_lease_words() -> None:
    entry = ordered_entry(line(material=None, label="apply_event(account_id=8)"), 60, LIVE)
    assert entry["label"] == "apply_event(account_id=8)"
    assert "material" not in entry and "gap_clock" not in entry


POLICY = BatchPolicy(KeySpec.build("account_id", lambda account_id: None, subject="t"), 100, 1.0)
BATCH = "baton:{batch:proj.index_docs:9c0d}"


def test_a_batch_key_with_calls_waiting_says_when_its_next_batch_is_due() -> None:
    entry = batch_entry(
        BatchLine(BATCH, "proj.index_docs", 12, 0.4, label="index_docs(account_id=7)"),
        POLICY,
        LIVE,
    )
    assert entry["kind"] == "batch" and entry["due_in"] == 0.6
    assert (entry["size"], entry["wait"], entry["runs"]) == (100, 1.0, [])
    assert batch_text(entry) == [
        BATCH,
        "    index_docs(account_id=7)",
        "    batch  12 waiting, oldest 0.4s  next batch due in 0.6s",
    ]
    full = batch_entry(BatchLine(BATCH, "proj.index_docs", 100, 0.1), POLICY, LIVE)
    assert full["due_in"] == 0 and batch_text(full)[-1].endswith("next batch due now")
    late = batch_entry(BatchLine(BATCH, "proj.index_docs", 3, 2.5), POLICY, LIVE)
    assert late["due_in"] == 0
    unknown = batch_entry(BatchLine(BATCH, "proj.gone", 3, 0.2), None, LIVE)
    assert unknown["due_in"] is None and unknown["size"] is None


def test_a_running_batch_names_its_worker_calls_and_ttl() -> None:
    runs = (BatchRun("w1@docs/ab12cd34/1", "w1@docs", 50, 7.9, 1.2),)
    stale = (BatchRun("w9@gone/ab12cd34/1", "w9@gone", 3, 2.0, 6.0),)
    entry = batch_entry(BatchLine(BATCH, "proj.index_docs", 0, 0.0, runs + stale), POLICY, LIVE)
    assert entry["due_in"] is None
    assert [r["stale"] for r in entry["runs"]] == [False, True]
    assert batch_text(entry) == [
        BATCH,
        "    running  batch of 50 calls  for 1.2s  ttl 7.9s",
        "    on w1@docs",
        "    running  batch of 3 calls  for 6.0s  ttl 2.0s",
        "    on w9@gone  STALE: stopped reporting",
    ]


def test_a_run_id_names_its_worker_and_when_it_was_claimed() -> None:
    run = _batch_run("w1@host/ab12cd34/1700000000123456", 1_700_000_010_123, 5, 1_700_000_002_123)
    assert (run.worker, run.calls, run.ttl_left, run.age) == ("w1@host", 5, 8.0, 2.0)


def test_a_batch_key_is_said_as_its_tasks_call() -> None:
    assert task_words("proj.index_docs", '{"account_id":7}') == "index_docs(account_id=7)"
    assert task_words("proj.index_docs", "") == "index_docs (the whole task)"


def test_the_page_shows_each_key_in_words_and_escapes_them() -> None:
    ordered = ordered_entry(line(material='{"account_id":"<b>"}'), 60, LIVE)
    page = _ordered([ordered])
    assert "apply_event(account_id=&#x27;&lt;b&gt;&#x27;)" in page and "<b>" not in page
    assert "skipped in 48.0s" in page and "<td>3</td>" in page
    running = ordered_entry(line(task_id="t-14", worker="w1@docs", ttl_left=3.0), 60, LIVE)
    assert "task <code>t-14</code> on w1@docs (ttl 3.0s)" in _ordered([running])
    assert "no ordered key" in _ordered([])
    runs = (BatchRun("w1@docs/ab/1", "w1@docs", 50, 7.9, 1.2),)
    batch = batch_entry(BatchLine(BATCH, "proj.index_docs", 12, 0.4, runs), POLICY, LIVE)
    row = _batches([batch])
    assert "<td>12</td><td>0.4s</td><td>in 0.6s</td>" in row
    assert "50 calls on w1@docs for 1.2s (ttl 7.9s)" in row
    assert "no batch key" in _batches([])
