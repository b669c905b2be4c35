"""Schedule changes at runtime (``ScheduleStore``) as the running Scheduler sees them.

The Scheduler in-process against the real store, with a controlled clock. Publishing is
recorded instead of sent (``RecordingScheduler``); real beat processes and workers are in
test_processes.py.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

import pytest
from celery import Celery
from celery.schedules import crontab

from celery_baton.beat import ScheduleStore
from celery_baton.errors import BeatEntryError
from tests.beat.conftest import Clock
from tests.beat.scheduler_helpers import Build, entry, tick


def test_runtime_api(
    make_app: Callable[..., Celery],
    clock: Clock,
    schedulers: Build,
    request: pytest.FixtureRequest,
) -> None:
    # cfg must not come due by itself in this test: the clock jumps to the server's time
    # below, and an hourly entry fired whenever the test ran in the 2 minutes before a
    # full hour (seen in CI).
    app = make_app({"cfg": entry(10_000_000.0)})
    s = schedulers(app, clock)
    tick(s)
    api = ScheduleStore(app)
    request.addfinalizer(api.close)
    api.add("dyn", "t.tick", 30, args=[1], options={"baton_misfire": "latest"})
    with pytest.raises(BeatEntryError, match="already exists"):
        api.add("dyn", "t.tick", 30)
    with pytest.raises(BeatEntryError, match="beat_schedule"):
        api.update("cfg", schedule=10)
    with pytest.raises(BeatEntryError, match="'bad'"):
        api.add("bad", "t.tick", "61 * * * *")
    with pytest.raises(BeatEntryError, match="unknown task"):
        api.add("ghost", "no.such.task", 10)
    with pytest.raises(BeatEntryError, match="> 0"):
        api.add("zero", "t.tick", 0)
    tick(s)
    listing = {e["name"]: e for e in api.describe()["entries"]}
    assert listing["dyn"]["source"] == "api"
    assert listing["dyn"]["policy"]["misfire"] == "latest"
    server_next = listing["dyn"]["next_slot"]
    assert server_next is not None
    # The API computed the slot from the server's clock; align the test clock on it.
    clock.ms = int(datetime.fromisoformat(server_next.replace("Z", "+00:00")).timestamp() * 1000)
    tick(s)
    assert [n for n, _, _ in s.sent] == ["dyn"]

    with pytest.raises(BeatEntryError, match=r"'dynn': does not exist \(did you mean `dyn`\?\)"):
        api.pause("dynn")
    api.pause("dyn")
    tick(s)
    clock.advance(120)
    tick(s)
    assert len(s.sent) == 1
    api.resume("dyn")
    tick(s)
    assert len(s.sent) == 1  # resumed from now: paused slots are not run
    api.trigger("cfg")
    tick(s)
    assert [n for n, _, _ in s.sent] == ["dyn", "cfg"]
    api.update("dyn", schedule=crontab(minute=0, hour=0))
    tick(s)
    api.remove("dyn")
    tick(s)
    listing = {e["name"]: e for e in api.describe()["entries"]}
    assert set(listing) == {"cfg"}
    described = api.describe()
    assert described["leader"]["owner"] == s.owner
    assert described["leader"]["lease_age_s"] >= 0


def test_a_claim_refused_by_a_change_says_what_changed(
    make_app: Callable[..., Celery],
    clock: Clock,
    schedulers: Build,
    request: pytest.FixtureRequest,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An entry paused after this beat last read the store: the log line names the
    change (it was paused), not the claim script's status number."""
    app = make_app({"every": entry(10.0)})
    s = schedulers(app, clock)
    tick(s)
    api = ScheduleStore(app)
    request.addfinalizer(api.close)
    api.pause("every")
    clock.advance(11)
    with caplog.at_level("INFO"):
        s.tick()  # not tick(s): the beat has not noticed the pause yet and claims
    lines = [r.getMessage() for r in caplog.records if "changed in the store" in r.getMessage()]
    assert lines == ["beat: entry 'every' changed in the store (it was paused); reloading"]
    assert s.sent == []
