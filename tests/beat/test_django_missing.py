"""``celery beat -S celery_baton.beat.django:DjangoScheduler`` where Django is not
installed: one line naming what is missing and the extra that brings it, and the beat
exits (before: Celery's beat logged a ``ModuleNotFoundError`` traceback one character a
line, about 700 lines, with no word of what to install).

Django is hidden from the beat by a module of that name that fails to import, ahead of
the installed one on its path (the test environment has Django)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.waiting import wait_until
from tests.support.workers import Workers

SAID = "django is not installed: install celery-baton with its [django] extra"


@pytest.mark.timeout(60)
def test_the_django_scheduler_without_django_says_what_to_install(
    workers: Workers, tmp_path: Path
) -> None:
    hidden = tmp_path / "no_django" / "django"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text(
        'raise ModuleNotFoundError("No module named \'django\'", name="django")\n'
    )
    beat = workers.start_beat(
        "tests.apps.beat_app",
        env={"PYTHONPATH": os.pathsep.join([str(hidden.parent), os.environ.get("PYTHONPATH", "")])},
        scheduler="celery_baton.beat.django:DjangoScheduler",
        wait=False,
    )
    wait_until(lambda: not beat.is_running, 30, "the beat to exit")
    log = beat.log_text()
    assert SAID in log, log[-2000:]
    assert len(log.splitlines()) < 60, f"{len(log.splitlines())} lines"
