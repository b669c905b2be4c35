"""A beat entry naming a task the app does not have suggests the one it has. No server."""

from __future__ import annotations

import pytest
from celery import Celery
from celery.beat import ScheduleEntry

from celery_baton.beat.entries import compile_entry, task_hint
from celery_baton.config import read_settings
from celery_baton.errors import BeatEntryError

REGISTERED = ["celery.backend_cleanup", "proj.tasks.tick", "proj.tasks.build_report"]


@pytest.mark.parametrize(
    ("task", "hint"),
    [
        ("proj.tasks.tik", " (did you mean `proj.tasks.tick`?)"),  # a typo
        ("tick", " (did you mean `proj.tasks.tick`?)"),  # the function's name
        ("tasks.build_report", " (did you mean `proj.tasks.build_report`?)"),  # no package
        ("proj.nothing_like_it", ""),
    ],
)
def test_task_hint(task: str, hint: str) -> None:
    assert task_hint(task, REGISTERED) == hint


def test_a_short_name_matching_several_tasks_names_each() -> None:
    assert task_hint("tick", ["b.tick", "a.tick"]) == " (did you mean `a.tick` or `b.tick`?)"


def test_a_refused_entry_names_the_registered_task() -> None:
    app = Celery("proj", set_as_current=False)

    # A name no shared task of the test apps has: Celery registers every @shared_task
    # in every app (a run that had imported tests.apps.url_given offered its `tick` too).
    @app.task(name="proj.tasks.digest_zq", shared=False)
    def digest_zq() -> None: ...

    entry = ScheduleEntry(name="every-5s", task="digest_zq", schedule=5.0, app=app)
    with pytest.raises(
        BeatEntryError,
        match=r"unknown task 'digest_zq' \(did you mean `proj\.tasks\.digest_zq`\?\)",
    ):
        compile_entry(entry, settings=read_settings({}, "redis://127.0.0.1:1/0"), app=app)
