"""A beat whose entries carry celery-baton options but that runs another scheduler says
so at start (baton.py, on Celery's beat_init). No server, no beat process."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from celery import Celery
from celery.beat import Scheduler as CeleryScheduler

from celery_baton.baton import _warn_if_beat_ignores_entry_options


def _app(options: dict[str, object]) -> Celery:
    app = Celery("choice", set_as_current=False)
    app.conf.beat_schedule = {
        "poll": {"task": "choice.poll", "schedule": 30.0, "options": options},
        "plain": {"task": "choice.plain", "schedule": 30.0},
    }
    return app


def test_celerys_scheduler_with_our_entry_options_is_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    scheduler = CeleryScheduler(_app({"baton_misfire": "all"}), lazy=False)
    with caplog.at_level(logging.WARNING, logger="celery_baton"):
        _warn_if_beat_ignores_entry_options(SimpleNamespace(scheduler=scheduler))
    [record] = [r for r in caplog.records if r.name == "celery_baton"]
    message = record.getMessage()
    assert "entries poll have celery-baton options" in message, message
    assert "celery.beat.Scheduler" in message and "celery_baton.beat:Scheduler" in message


def test_entries_without_our_options_say_nothing(caplog: pytest.LogCaptureFixture) -> None:
    scheduler = CeleryScheduler(_app({"queue": "beat"}), lazy=False)
    with caplog.at_level(logging.WARNING, logger="celery_baton"):
        _warn_if_beat_ignores_entry_options(SimpleNamespace(scheduler=scheduler))
    assert not [r for r in caplog.records if r.name == "celery_baton"]
