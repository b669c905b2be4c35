"""`celery -A app baton status|locks|limits|schedule|unlock`, run as real commands against a
real worker holding real leases."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from tests.support.observer import Observer
from tests.support.processes import REPO_ROOT
from tests.support.waiting import wait_until
from tests.support.workers import Workers, _process_env

APP = "tests.apps.exclusive"


def baton(workers: Workers, *args: str, app: str = APP) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", app, "baton", *args],
        env=_process_env(workers.env),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def as_json(workers: Workers, *args: str, app: str = APP) -> Any:
    done = baton(workers, *args, "--json", app=app)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_status_locks_and_unlock(workers: Workers, observer: Observer) -> None:
    from tests.apps.exclusive import ex_skip

    worker = workers.start(APP, concurrency=2)
    running = ex_skip.delay("cli", 10.0)  # outlives the five commands below
    observer.starts_of("cli")

    status = as_json(workers, "status")
    assert "127.0.0.1" in status["store"] and status["rtt_ms"] > 0
    assert status["server"].split()[-1][0].isdigit()
    assert [w["hostname"] for w in status["workers"]] == [worker.hostname]
    assert status["workers"][0]["leases"] == 1

    locks = as_json(workers, "locks")
    assert len(locks) == 1
    lock = locks[0]
    assert lock["task_id"] == running.id and lock["worker"] == worker.hostname
    assert lock["kind"] == "exclusive" and 0 < lock["ttl_left"] <= 30 and lock["fence"] > 0

    table = baton(workers, "locks")
    assert table.returncode == 0
    assert all(len(line) <= 80 for line in table.stdout.splitlines()), table.stdout

    refused = baton(workers, "unlock", lock["key"])
    assert refused.returncode != 0
    assert running.id in refused.stderr and "--force" in refused.stderr
    assert len(as_json(workers, "locks")) == 1

    forced = as_json(workers, "unlock", lock["key"], "--force")
    assert forced["removed"] == 1
    assert as_json(workers, "locks") == []
    assert running.get(timeout=20)


def test_limits_set_and_clear(workers: Workers) -> None:
    app = "tests.apps.limits"
    listing = as_json(workers, "limits", app=app)
    rated = [t for t in listing["tasks"] if t["rate"]]
    assert rated, listing
    name = rated[0]["task"]
    as_json(workers, "limits", "set", name, "--rate", "5/s", "--burst", "2", app=app)
    after = {t["task"]: t for t in as_json(workers, "limits", app=app)["tasks"]}
    assert after[name]["overrides"] == {"rate": "200000 2"}
    text = baton(workers, "limits", app=app).stdout
    assert "rate 5/s burst 2" in text
    as_json(workers, "limits", "clear", name, app=app)
    cleared = {t["task"]: t for t in as_json(workers, "limits", app=app)["tasks"]}
    assert cleared[name]["overrides"] == {}

    bad = baton(workers, "limits", "set", name, "--rate", "10/x", app=app)
    assert bad.returncode != 0 and "10/x" in bad.stderr


def test_schedule_lists_nothing_without_beat(workers: Workers) -> None:
    data = as_json(workers, "schedule")
    assert data["entries"] == [] and data["leader"] is None
    assert "no entries" in baton(workers, "schedule").stdout


def test_status_shows_the_requests_held_now_not_a_running_total(
    workers: Workers, observer: Observer
) -> None:
    from tests.apps.exclusive import ex_wait

    worker = workers.start(APP, concurrency=2)
    results = [ex_wait.delay("held-now", 1.5) for _ in range(3)]  # one runs, two wait
    observer.starts_of("held-now")

    def held() -> int:
        [report] = [w for w in as_json(workers, "status")["workers"]]
        assert report["hostname"] == worker.hostname
        return int(report["held"])

    wait_until(lambda: held() == 2, timeout=20, what="two requests held")
    for result in results:
        assert result.get(timeout=30)
    wait_until(lambda: held() == 0, timeout=20, what="none held once all ran")
