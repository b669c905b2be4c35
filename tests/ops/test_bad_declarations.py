"""A bad task option stops a worker, beat and the CLI with one line naming the task and
the option, whether ``Baton(app)`` was made before the task was declared or after it
(issue 39 §2, §5): real processes, the ``celery`` command as users run it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.ops.test_bad_input import _one_line
from tests.support.celery_processes import _process_env
from tests.support.processes import REPO_ROOT
from tests.support.waiting import wait_until
from tests.support.workers import Workers

APP = "tests.apps.late_baton"

CASES = [
    ({"exclusiv": "feed_url"}, "import_feed: unknown task option `exclusiv`"),
    ({"global_rate_limit": "5/x"}, "import_feed.global_rate_limit: unknown unit in '5/x'"),
    ({"exclusive": "{k"}, "import_feed.exclusive: template '{k' is not a format string"),
]
IDS = ["typo", "bad-rate", "bad-template"]


def _env(options: dict[str, object], order: str) -> dict[str, str]:
    return {"DECLARED": json.dumps(options), "BATON_ORDER": order}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("order", ["first", "after", "include"])
@pytest.mark.parametrize(("options", "expected"), CASES, ids=IDS)
def test_the_cli_refuses_a_bad_declaration_in_one_line(
    workers: Workers, options: dict[str, object], expected: str, order: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", APP, "baton", "status"],
        env=_process_env({**workers.env, **_env(options, order)}),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0, done.stdout
    assert "Traceback" not in done.stderr, done.stderr
    assert _one_line(done.stderr) == [_one_line(done.stderr)[0]], done.stderr
    assert expected in done.stderr, done.stderr


@pytest.mark.timeout(180)
@pytest.mark.parametrize("order", ["first", "after", "include"])
def test_a_worker_and_beat_refuse_a_bad_declaration_in_one_line(
    workers: Workers, order: str
) -> None:
    options, expected = CASES[0]
    env = _env(options, order)
    worker = workers.start(APP, env=env, wait=False, concurrency=1)
    beat = workers.start_beat(APP, env=env, scheduler="celery_baton.beat:Scheduler", wait=False)
    for process in (worker, beat):
        wait_until(lambda p=process: not p.is_running, 60, f"{process!r} to refuse")
        log = process.log_text()
        assert process.returncode != 0, log
        assert "Traceback" not in log, log
        lines = _one_line(log)
        assert len(lines) == 1, log
        assert expected in lines[0], log
