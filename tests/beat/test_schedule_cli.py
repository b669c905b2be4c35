"""`celery -A app baton schedule pause | resume | trigger | history NAME` against real
beats and a real worker (issue 13 §4): pause and resume survive a change of leader,
trigger fires one extra run with its own id, history lists runs with their outcome."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import pytest

from tests.beat.helpers import beat_env
from tests.support.celery_processes import _process_env
from tests.support.observer import Observer
from tests.support.processes import REPO_ROOT
from tests.support.waiting import wait_until
from tests.support.workers import Workers

APP = "tests.apps.beat_app"


def baton(workers: Workers, env: dict[str, str], *args: str) -> Any:
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", APP, "baton", *args, "--json"],
        env=_process_env({**workers.env, **env}),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def fired(workers: Workers, env: dict[str, str]) -> list[dict[str, Any]]:
    return [x for x in baton(workers, env, "schedule", "history", "every1") if x["kind"] == "fired"]


# ~15-30 s here, ~50 s at twice the cores in load; its many `celery baton` commands each
# start a Python process, and one loaded run took more than 120 s in all.
@pytest.mark.timeout(300)
def test_pause_resume_trigger_and_history(workers: Workers, observer: Observer) -> None:
    env = beat_env({"every1": {"every": 1}})
    workers.start(APP, env=env, concurrency=2)
    first = workers.start_beat(APP, env=env)
    workers.start_beat(APP, env=env)
    wait_until(lambda: len(fired(workers, env)) >= 2, 40, "two slots fired")
    history = baton(workers, env, "schedule", "history", "every1")
    assert all(line["slot"].endswith("Z") for line in history if line.get("slot"))  # times
    wait_until(lambda: any(x["state"] == "SUCCESS" for x in fired(workers, env)), 30, "an outcome")

    baton(workers, env, "schedule", "pause", "every1")
    time.sleep(1.5)  # a slot being fired as the pause lands may still go out
    # The newest slot fired, not a count: the history lists the 10 newest lines, which
    # a loaded machine fills with fired ones before the pause (then no count grows).
    before = max(x["slot"] for x in fired(workers, env))
    first.kill()  # a leader change while paused: the pause is in the store, it holds
    time.sleep(9)  # the other beat takes over (lease 6 s) and must fire nothing
    assert max(x["slot"] for x in fired(workers, env)) == before

    baton(workers, env, "schedule", "trigger", "every1")
    wait_until(
        lambda: any(
            x["kind"] == "triggered" for x in baton(workers, env, "schedule", "history", "every1")
        ),
        20,
        "the triggered run",
    )
    triggered = [
        x for x in baton(workers, env, "schedule", "history", "every1") if x["kind"] == "triggered"
    ]
    assert len(triggered) == 1 and triggered[0]["id"]
    assert triggered[0]["id"] not in {x["id"] for x in fired(workers, env)}

    baton(workers, env, "schedule", "resume", "every1")
    wait_until(
        lambda: max(x["slot"] for x in fired(workers, env)) > before, 20, "fired after resume"
    )
    assert "standing by" in "".join(p.log_text() for p in workers.started)


def text(workers: Workers, env: dict[str, str], *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", APP, "baton", *args],
        env=_process_env({**workers.env, **env, "COLUMNS": "80"}),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.timeout(120)
def test_ids_are_whole_and_a_trigger_with_no_beat_leading_says_so(workers: Workers) -> None:
    """`schedule` cut task ids at 80 columns (the docs promise never to cut an id), and
    `schedule trigger` said "one extra run requested" when no beat would run it
    (issue 39 §4)."""
    env = beat_env({"every1_with_a_longer_name_than_most": {"every": 1}})
    beat = workers.start_beat(APP, env=env)
    wait_until(
        lambda: all(e.get("last_id") for e in baton(workers, env, "schedule")["entries"]),
        40,
        "a slot fired",
    )
    beat.stop()  # a clean stop resigns the leader lease: no beat leads now
    (entry,) = baton(workers, env, "schedule")["entries"]
    listing = text(workers, env, "schedule")
    assert entry["last_id"] in listing, listing
    said = text(workers, env, "schedule", "trigger", entry["name"])
    assert "no beat leads" in said, said


def test_an_app_on_redbeat_is_told_why_it_has_no_entries(workers: Workers) -> None:
    """`schedule` of an app whose beat is RedBeat said only "no entries" (its entries
    are RedBeat's, not in celery-baton's store): now it says so, and how to import them."""
    env = {"BEAT_CONF": json.dumps({"beat_scheduler": "redbeat.RedBeatScheduler"})}
    listing = text(workers, env, "schedule")
    assert "this app's beat_scheduler is redbeat.RedBeatScheduler" in listing, listing
    assert "schedule import --from-redbeat" in listing, listing
