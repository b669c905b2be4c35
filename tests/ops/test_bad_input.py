"""Bad input is one line naming the setting, never a traceback: from the CLI, a worker
and beat, run as real processes (issue 28 §5)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.celery_processes import _process_env
from tests.support.processes import REPO_ROOT
from tests.support.waiting import wait_until
from tests.support.workers import Workers

APP = "tests.apps.bad_settings"
BAD_PORT = "redis://127.0.0.1:notaport/1"
TYPOS = {"baton_lease_tl": 5, "baton_hold_mx": 3}


def _cli(workers: Workers, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", APP, "baton", *args],
        env=_process_env({**workers.env, **env}),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _one_line(text: str) -> list[str]:
    """The lines of a refusal, without the warnings Celery prints for a root user."""
    return [
        line
        for line in text.splitlines()
        if line.strip()
        and "SecurityWarning" not in line
        and "superuser" not in line
        and not line.startswith(("absolutely", "Please specify", "User information", "  "))
        and "celery beat v" not in line
    ]


def test_a_store_url_with_a_bad_port_is_one_line_from_the_cli(workers: Workers) -> None:
    done = _cli(workers, "status", env={"BATON_URL": BAD_PORT})
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr
    assert "baton_url" in done.stderr and "notaport" in done.stderr, done.stderr
    assert len(_one_line(done.stderr)) == 1, done.stderr


def test_a_web_port_out_of_range_is_one_line(workers: Workers, store_url: str) -> None:
    done = _cli(workers, "web", "--port", "99999", env={"BATON_URL": store_url})
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr
    assert "99999" in done.stderr and "--port" in done.stderr, done.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"BATON_URL": BAD_PORT}, ["baton_url", "notaport"]),
        (
            {"BAD_SETTINGS": json.dumps(TYPOS)},
            ["did you mean `baton_lease_ttl`", "did you mean `baton_hold_max`"],
        ),
    ],
    ids=["bad-port", "two-typos"],
)
def test_a_worker_and_beat_refuse_a_bad_setting_in_one_line(
    workers: Workers, env: dict[str, str], expected: list[str]
) -> None:
    worker = workers.start(APP, env=env, wait=False, concurrency=1)
    beat = workers.start_beat(APP, env=env, scheduler="celery_baton.beat:Scheduler", wait=False)
    for process in (worker, beat):
        wait_until(lambda p=process: not p.is_running, 60, f"{process!r} to refuse")
        log = process.log_text()
        assert process.returncode != 0
        assert "Traceback" not in log, log
        lines = _one_line(log)
        assert len(lines) == 1, log
        assert all(word in lines[0] for word in expected), log
