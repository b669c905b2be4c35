"""``baton unlock``: a forced unlock of a running task's lease is one incident, reported
once (issue 39 §4); ``unlock --task NAME`` and ``--all`` free what ``locks`` shows, in
place of celery-once's ``clear_locks(app)`` or a ``redis-cli DEL`` (issue 39 §3). Real
commands against a real worker holding real leases."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.ops.test_commands import as_json, baton
from tests.support.celery_processes import _process_env
from tests.support.observer import Observer
from tests.support.processes import REPO_ROOT
from tests.support.waiting import wait_until
from tests.support.workers import Workers

APP = "tests.apps.exclusive"


@pytest.mark.timeout(120)
def test_a_forced_unlock_of_a_running_lease_is_reported_once(
    workers: Workers, observer: Observer
) -> None:
    """Before: one pair of ERROR lines per renewal until the run ended (5 pairs for a
    run of 5 renewals), and the worker's losses counter said 5."""
    from tests.apps.exclusive import ex_skip

    # lease_ttl 1.5 s: a renewal every 0.5 s, many of them while the run goes on.
    worker = workers.start(APP, concurrency=1, env={"BATON_TEST_APP_LEASE_TTL": "1.5"})
    ex_skip.delay("unlocked", 30.0)
    observer.starts_of("unlocked")
    (lock,) = as_json(workers, "locks")
    assert as_json(workers, "unlock", lock["key"], "--force")["removed"] == 1
    wait_until(lambda: "lease lost" in worker.log_text(), 20, "the loss to be seen")
    time.sleep(3.0)  # six renewal intervals more
    log = worker.log_text()
    assert log.count("lease lost") == 1, log
    assert log.count("lost its lease") == 1, log
    worker.kill()  # the run would go on for 30 s; nothing more to see


def _unlock(workers: Workers, *args: str, answer: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", APP, "baton", "unlock", *args],
        env=_process_env(workers.env),
        cwd=REPO_ROOT,
        input=answer,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.timeout(300)  # ten commands, each seconds long on a loaded machine
def test_unlock_a_task_or_all_after_asking(workers: Workers, observer: Observer) -> None:
    """celery-once's and celery-singleton's ``clear_locks(app)`` had no command: the
    guide said ``redis-cli --scan`` then ``DEL`` (issue 39 §3)."""
    from tests.apps.exclusive import ex_skip, uq_idle

    worker = workers.start(APP, concurrency=1)
    ex_skip.delay("many", 300.0)  # outlives the commands below
    observer.starts_of("many")
    for n in range(3):
        uq_idle.delay(f"idle-{n}")  # queued where no worker reads: claims stay
    claims = [r for r in as_json(workers, "locks") if r["task"] == uq_idle.name]
    assert len(claims) == 3

    # Claims only, without --force: said at once, not asked about and then kept.
    claimed = _unlock(workers, "--task", uq_idle.name, answer="y\n")
    assert claimed.returncode == 1 and "[y/N]" not in claimed.stderr, claimed.stderr
    assert "3 unique claim(s), each of a queued" in claimed.stderr, claimed.stderr
    declined = _unlock(workers, "--task", uq_idle.name, "--force", answer="n\n")
    assert declined.returncode != 0 and "nothing freed" in declined.stderr, declined.stderr
    assert "3 unique claim(s)" in declined.stderr, declined.stderr
    assert declined.stderr.count("unique ") >= 3, declined.stderr  # each listed first
    # A task name typed wrong is said to be wrong, not "nothing to free" (a newcomer's
    # first try, `proj.tasks.x` for `proj.x`, went unnoticed).
    typo = _unlock(workers, "--task", uq_idle.name + "x", "--force", "--yes")
    assert typo.returncode != 0 and f"did you mean {uq_idle.name}" in typo.stderr, typo.stderr
    assert len(as_json(workers, "locks")) == 4

    done = _unlock(workers, "--task", uq_idle.name, "--force", "--yes")
    assert done.returncode == 0 and "3 freed" in done.stdout, done.stdout + done.stderr
    assert [r["kind"] for r in as_json(workers, "locks")] == ["exclusive"]

    kept = _unlock(workers, "--all", answer="y\n")
    assert kept.returncode == 0 and "1 kept" in kept.stdout, kept.stdout + kept.stderr
    assert len(as_json(workers, "locks")) == 1  # a live run's lease needs --force
    freed = _unlock(workers, "--all", "--force", "--yes")
    assert freed.returncode == 0 and "1 freed" in freed.stdout, freed.stdout
    assert as_json(workers, "locks") == []
    worker.kill()


def test_unlock_needs_one_of_key_task_or_all(workers: Workers) -> None:
    done = baton(workers, "unlock")
    assert done.returncode != 0 and "--task NAME, or --all" in done.stderr, done.stderr
