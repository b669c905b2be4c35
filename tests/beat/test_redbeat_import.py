"""`celery -A app baton schedule import --from-redbeat` (issue 13 §4): entries kept by
celery-redbeat (its hash format, written here as redbeat 2.x writes it) come into the
schedule without retyping; what cannot be imported is named, not dropped silently."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import redis

from tests.support.celery_processes import _process_env
from tests.support.processes import REPO_ROOT
from tests.support.workers import Workers

APP = "tests.apps.beat_app"
TASK = "tests.apps.beat_app.record"


def redbeat_entry(r: redis.Redis, name: str, schedule: dict[str, Any], **more: Any) -> None:
    definition = {
        "name": name,
        "task": more.pop("task", TASK),
        "args": [name],
        "kwargs": {},
        "options": {},
        "schedule": schedule,
        "enabled": more.pop("enabled", True),
    }
    r.hset(f"redbeat:{name}", mapping={"definition": json.dumps(definition), "meta": "{}"})
    r.zadd("redbeat::schedule", {f"redbeat:{name}": 0})


def test_import_from_redbeat(workers: Workers, broker_url: str, store_url: str) -> None:
    with redis.Redis.from_url(broker_url, decode_responses=True) as r:
        redbeat_entry(r, "every10", {"__type__": "interval", "every": 10.0, "relative": False})
        redbeat_entry(
            r,
            "nightly",
            {"__type__": "crontab", "minute": "0", "hour": "3", "day_of_week": "*",
             "day_of_month": "*", "month_of_year": "*"},
        )  # fmt: skip
        redbeat_entry(r, "off", {"__type__": "interval", "every": 60.0}, enabled=False)
        redbeat_entry(r, "rrule", {"__type__": "rrule", "freq": 3})
        redbeat_entry(r, "ghost", {"__type__": "interval", "every": 5.0}, task="no.such.task")

    def run(*args: str) -> dict[str, Any]:
        done = subprocess.run(
            [sys.executable, "-m", "celery", "-A", APP, "baton", "schedule", "import",
             "--from-redbeat", "--redbeat-url", broker_url, *args, "--json"],
            env=_process_env(workers.env),
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        result: dict[str, Any] = json.loads(done.stdout)
        return result

    report = run()
    assert sorted(report["imported"]) == ["every10", "nightly", "off"]
    assert report["paused"] == ["off"]
    assert set(report["skipped"]) == {"rrule", "ghost"}
    assert "rrule" in report["skipped"]["rrule"] and "no.such.task" in report["skipped"]["ghost"]

    from celery_baton.beat import ScheduleStore
    from tests.apps.beat_app import app

    with ScheduleStore(app) as schedules:
        entries = {e["name"]: e for e in schedules.describe()["entries"]}
    assert {"every10", "nightly", "off"} <= set(entries)
    assert entries["off"]["paused"] and not entries["every10"]["paused"]
    assert entries["every10"]["task"] == TASK

    again = run()  # nothing doubled
    assert again["imported"] == [] and "already in the schedule" in again["skipped"]["every10"]
