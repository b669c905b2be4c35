"""A unique claim in words (issue 39 §4): ``locks`` and the web view showed a lease's key
in words (``import_feed(feed_url='...')``) but a unique claim as its hash alone. The
words are written with the claim, at publish, by a real publishing process."""

from __future__ import annotations

from tests.ops.test_commands import as_json, baton
from tests.support.workers import Workers


def test_locks_show_a_unique_claim_in_words(workers: Workers) -> None:
    from tests.apps.exclusive import uq_idle

    uq_idle.delay("report-7")  # queued where no worker reads: the claim stays
    (claim,) = [r for r in as_json(workers, "locks") if r["task"] == uq_idle.name]
    assert claim["kind"] == "unique"
    assert claim["label"] == "uq_idle(key='report-7')", claim
    assert "uq_idle(key='report-7')" in baton(workers, "locks").stdout
