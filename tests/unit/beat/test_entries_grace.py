"""An entry's misfire grace, and Celery's ``beat_cron_starting_deadline``. No server.

Celery's setting (5.5+) says of a crontab entry what ``baton_misfire_grace`` says of
any: a missed run older than it is not caught up, a newer one runs once. A migrating
app that set it keeps that meaning: it is the grace of its crontab entries, unless the
entry names its own.
"""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery
from celery.beat import ScheduleEntry
from celery.schedules import crontab

from celery_baton.beat.entries import compile_entry
from celery_baton.config import read_settings

DEADLINE = {"beat_cron_starting_deadline": 600}


def _grace(schedule: Any, options: dict[str, Any], **conf: Any) -> float:
    app = Celery("proj", set_as_current=False)
    app.conf.update(conf)

    @app.task(name="proj.tasks.grace_tick", shared=False)
    def grace_tick() -> None: ...

    entry = ScheduleEntry(
        name="e", task="proj.tasks.grace_tick", schedule=schedule, options=options, app=app
    )
    settings = read_settings(app.conf, "redis://127.0.0.1:1/0")
    compiled = compile_entry(entry, settings=settings, app=app)
    return compiled.policy.grace


@pytest.mark.parametrize(
    ("schedule", "options", "conf", "grace"),
    [
        (crontab(minute="*"), {}, DEADLINE, 600.0),
        (crontab(minute="*"), {"baton_misfire_grace": 5}, DEADLINE, 5.0),
        (crontab(minute="*"), {}, {}, 30.0),
        (10.0, {}, DEADLINE, 30.0),  # crontab entries only
        (crontab(minute="*"), {}, {"baton_beat_misfire_grace": 60}, 60.0),
    ],
)
def test_a_crontab_entrys_grace_is_celerys_starting_deadline_unless_it_names_its_own(
    schedule: Any, options: dict[str, Any], conf: dict[str, Any], grace: float
) -> None:
    assert _grace(schedule, options, **conf) == grace
