"""``baton.cancel`` on bad input, in the caller's process (against the real store):
refused early with one line, or, for a task name this app does not know (a publisher
that sends tasks by name), kept and said."""

from __future__ import annotations

import logging

import pytest

from celery_baton import BatonError, KeySpecError


def test_bad_input_is_refused_with_one_line(app_environ: None) -> None:
    from tests.apps.cancel import baton, keyed

    with pytest.raises(BatonError, match="not both"):
        baton.cancel("some-id", task=keyed, key={"account_id": 1}, ttl=60)
    with pytest.raises(BatonError, match="give a task id"):
        baton.cancel(task=keyed, ttl=60)
    with pytest.raises(BatonError, match="ttl must be seconds"):
        baton.cancel("some-id", ttl=-1)
    with pytest.raises(KeySpecError, match="acount_id"):
        baton.cancel(task=keyed, key={"acount_id": 1}, ttl=60)


def test_a_name_this_app_does_not_know_is_kept_and_said(
    app_environ: None, caplog: pytest.LogCaptureFixture
) -> None:
    from tests.apps.cancel import baton

    with caplog.at_level(logging.WARNING, logger="celery_baton"):
        done = baton.cancel(task="tests.apps.cancel.kyed", key={"account_id": 1}, ttl=60)
    assert "kyed" in done.what
    assert any("not a task of this app" in r.getMessage() for r in caplog.records)
