"""A beat entry's options are checked as task options are: a misspelt ``baton_*`` option
refuses the entry with a suggestion, never leaves it on the default policy (issue 28 §6).

The Scheduler in-process against the real store (tests/beat/conftest.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery

from celery_baton.beat import ScheduleStore, describe_schedule
from celery_baton.errors import BeatEntryError
from tests.beat.conftest import Clock, RecordingScheduler
from tests.beat.scheduler_helpers import entry, tick

Build = Callable[[Celery, Clock], RecordingScheduler]


def test_a_misspelt_entry_option_refuses_the_entry_at_beat_start(
    make_app: Callable[..., Celery], clock: Clock, schedulers: Build
) -> None:
    app = make_app(
        {
            "typo": entry(5.0, baton_misfir="latest"),
            "bare": entry(5.0, misfire="latest", baton_overlp="skip"),
            "percall": entry(5.0, baton={"exclusiv": "x"}),
            "good": entry(5.0, baton_misfire="latest", queue="celery"),
        }
    )
    s = schedulers(app, clock)
    tick(s)
    clock.advance(5)
    tick(s)
    assert {n for n, _, _ in s.sent} == {"good"}
    refused = describe_schedule(s._store, app="beat_inproc")["refused"]  # type: ignore[arg-type]
    assert set(refused) == {"typo", "bare", "percall"}, refused
    assert "`baton_misfir` (did you mean `baton_misfire`?)" in refused["typo"]
    assert "`misfire` (did you mean `baton_misfire`?)" in refused["bare"]
    assert "`baton_overlp` (did you mean `baton_overlap`?)" in refused["bare"]
    assert "did you mean `exclusive`" in refused["percall"]


def test_a_misspelt_entry_option_is_refused_by_the_schedule_api(
    make_app: Callable[..., Celery], request: pytest.FixtureRequest
) -> None:
    app = make_app({})
    api = ScheduleStore(app)
    request.addfinalizer(api.close)
    options: dict[str, Any] = {"baton_misfir": "latest"}
    with pytest.raises(BeatEntryError, match=r"did you mean `baton_misfire`"):
        api.add("dyn", "t.tick", 30, options=options)
    assert api.describe()["entries"] == []
