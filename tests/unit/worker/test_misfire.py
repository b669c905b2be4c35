"""worker/misfire.py: what a held beat slot admitted past its misfire grace does."""

from __future__ import annotations

from celery_baton.core.policy.headers import BEAT_SLOT_HEADER, MISFIRE_HEADER
from celery_baton.worker.misfire import late_slot

SLOT = 1_780_000_000_000


def headers(misfire: str, grace: float = 2.0, next_ms: int = SLOT + 1000) -> dict[str, object]:
    return {
        BEAT_SLOT_HEADER: SLOT,
        "baton_beat_entry": "every1",
        MISFIRE_HEADER: {"misfire": misfire, "grace": grace, "next": next_ms},
    }


def test_on_time_or_not_a_scheduled_slot_runs_as_usual() -> None:
    assert late_slot(headers("skip", next_ms=SLOT + 10_000), SLOT + 2000) is None  # in grace
    assert late_slot({BEAT_SLOT_HEADER: SLOT}, SLOT + 60_000) is None  # a trigger
    assert late_slot({}, SLOT + 60_000) is None  # no beat slot


def test_past_the_grace_each_policy_decides() -> None:
    skipped = late_slot(headers("skip", next_ms=SLOT + 10_000), SLOT + 2001)
    assert skipped is not None and not skipped.run
    assert "'every1'" in skipped.message and "misfire grace (2s)" in skipped.message
    ran = late_slot(headers("all", next_ms=SLOT + 10_000), SLOT + 60_000)
    assert ran is not None and ran.run
    # latest: runs while no later slot of the entry is due, else skipped
    latest = late_slot(headers("latest", next_ms=SLOT + 10_000), SLOT + 5000)
    assert latest is not None and latest.run
    stale = late_slot(headers("latest", next_ms=SLOT + 10_000), SLOT + 10_000)
    assert stale is not None and not stale.run


def test_an_unreadable_header_runs_the_slot() -> None:
    bad = {BEAT_SLOT_HEADER: SLOT, MISFIRE_HEADER: {"misfire": "skip"}}
    assert late_slot(bad, SLOT + 60_000) is None


def test_a_held_slot_whose_next_slot_is_due_is_coalesced_into_it() -> None:
    """Several held slots of one entry admitted together: the older ones are not run
    (the newest runs for them), within the grace too; ``all`` runs each."""
    for policy in ("skip", "latest"):
        older = late_slot(headers(policy, grace=30), SLOT + 1000)
        assert older is not None and not older.run
        assert "coalesced into the later slot" in older.message, older.message
        assert "recorded as missed" in older.message
        assert late_slot(headers(policy, grace=30), SLOT + 999) is None  # the newest runs
    assert late_slot(headers("all", grace=30), SLOT + 5000) is None
    # A message without the next slot (an older beat's) is not coalesced.
    assert late_slot(headers("skip", grace=30, next_ms=0), SLOT + 5000) is None
