"""`celery -A app baton status|locks|limits|schedule|unlock`, run as real commands against a
real worker holding real leases."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.celery_processes import _process_env
from tests.support.observer import Observer
from tests.support.processes import REPO_ROOT
from tests.support.waiting import wait_until
from tests.support.workers import Workers

APP = "tests.apps.exclusive"


def baton(
    workers: Workers, *args: str, app: str = APP, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``celery -A app baton *args``, in the workers' environment (``env``: some of it
    replaced)."""
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", app, "baton", *args],
        env=_process_env({**workers.env, **(env or {})}),
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
    running = ex_skip.delay("cli", 40.0)  # outlives the commands below, even on a slow machine
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
    # The key is printed whole on a line of its own (to paste into `unlock`); what
    # describes its holder fits 80 columns.
    assert lock["key"] in table.stdout.splitlines()
    described = [line for line in table.stdout.splitlines() if line != lock["key"]]
    assert all(len(line) <= 80 for line in described), table.stdout

    refused = baton(workers, "unlock", lock["key"])
    assert refused.returncode != 0
    assert running.id in refused.stderr and "--force" in refused.stderr
    assert len(as_json(workers, "locks")) == 1

    forced = as_json(workers, "unlock", lock["key"], "--force")
    assert forced["removed"] == 1
    assert as_json(workers, "locks") == []
    worker.kill()  # the run would go on for 300 s; nothing more to see


@pytest.mark.timeout(180)  # a dozen commands, each starting Celery: seconds apiece when loaded
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


@pytest.mark.timeout(180)  # ~30-40 s here; 60 s is the default
def test_status_shows_the_requests_held_now_not_a_running_total(
    workers: Workers, observer: Observer
) -> None:
    from tests.apps.exclusive import ex_wait

    worker = workers.start(APP, concurrency=2)
    # One runs 20 s, two wait for it, then run 1 s each. Two are held for 20 s: long
    # enough for a few `status` commands, each seconds apiece on a loaded machine (with
    # three runs of 5 s, two were held for 5 s only, and a loaded run never saw it).
    results = [ex_wait.delay("held-now", 20.0)]
    observer.starts_of("held-now")
    results += [ex_wait.delay("held-now", 1.0) for _ in range(2)]

    def held() -> int:
        [report] = [w for w in as_json(workers, "status")["workers"]]
        assert report["hostname"] == worker.hostname
        return int(report["held"])

    wait_until(lambda: held() == 2, timeout=20, what="two requests held")
    for result in results:
        assert result.get(timeout=90)
    wait_until(lambda: held() == 0, timeout=20, what="none held once all ran")


@pytest.mark.timeout(180)  # six commands, each starting Celery: >60 s at 10x the cores in load
def test_locks_show_whole_keys_and_unique_claims_that_unlock_frees(
    workers: Workers, observer: Observer
) -> None:
    from tests.apps.exclusive import mx_skip

    worker = workers.start(APP, concurrency=2)
    # Runs past the six commands below (seconds apiece on a loaded machine: at 40 s, the
    # run had ended and freed its claim before `unlock --force`); killed at the end.
    running = mx_skip.delay("a-rather-long-key-name-" * 3, "sleep", 300.0, 1)
    observer.starts_of("a-rather-long-key-name-" * 3)
    rows = as_json(workers, "locks")
    assert {r["kind"] for r in rows} == {"exclusive", "unique"}, rows
    claim = next(r for r in rows if r["kind"] == "unique")
    assert claim["task_id"] == running.id
    text = baton(workers, "locks").stdout
    for row in rows:  # whole keys, ready to paste into `unlock`
        assert row["key"] in text, text

    refused = baton(workers, "unlock", claim["key"])
    assert refused.returncode != 0 and running.id in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr
    freed = as_json(workers, "unlock", claim["key"], "--force")
    assert freed["removed"] == 1
    assert [r["kind"] for r in as_json(workers, "locks")] == ["exclusive"]

    missing = baton(workers, "unlock", claim["key"])
    assert missing.returncode != 0 and "no such lease" in missing.stderr, missing.stderr
    worker.kill()  # the run would go on for 300 s; nothing more to see


@pytest.mark.timeout(240)
def test_a_lease_of_a_worker_that_stopped_reporting_is_stale(
    workers: Workers, observer: Observer
) -> None:
    from tests.apps.exclusive import ex_skip

    # A lease that outlives the worker's reports: with the default lease_ttl (8 s,
    # renewed every third of it) a dead worker's lease may end before its reports do,
    # and then there is nothing stale left to show. After the kill this test runs five
    # commands while the lease must still be there: each starts Celery, seconds apiece
    # on a loaded machine, so the lease lasts 60 s. (A store up less than 60 s, new to
    # this session, holds the first lease back until its start + 60 s.)
    worker = workers.start(APP, concurrency=1, env={"BATON_TEST_APP_LEASE_TTL": "60"})
    ex_skip.delay("stale", 120.0)
    observer.starts_of("stale", timeout=90)
    worker.kill()  # SIGKILL: its lease lives on until lease_ttl, its reports stop
    wait_until(
        lambda: as_json(workers, "status")["workers"] == [], timeout=20, what="reports expire"
    )
    [lock] = as_json(workers, "locks")
    assert lock["stale"] is True
    assert "STALE" in baton(workers, "locks").stdout
    refused = baton(workers, "unlock", lock["key"])
    assert refused.returncode != 0
    assert "stopped reporting" in refused.stderr and "live run" not in refused.stderr
    assert as_json(workers, "status")["stale_leases"] == 1


def test_a_cleanly_stopped_worker_leaves_status_at_once(workers: Workers) -> None:
    worker = workers.start(APP, concurrency=1)
    wait_until(lambda: as_json(workers, "status")["workers"], timeout=20, what="a report")
    assert worker.stop() == 0
    assert as_json(workers, "status")["workers"] == []


def test_limits_set_refuses_what_would_change_nothing(workers: Workers) -> None:
    app = "tests.apps.limits"
    rated = next(t for t in as_json(workers, "limits", app=app)["tasks"] if t["rate"])
    cases = {
        "tests.apps.limits.no_such_task": "no task named",
        rated["task"].rsplit(".", 1)[1]: "not a full task name",
    }
    for task, why in cases.items():
        done = baton(workers, "limits", "set", task, "--rate", "5/s", app=app)
        assert done.returncode == 2 and why in done.stderr, done.stderr
    # The short name is answered with the full one, as `unlock --task` does.
    assert f"did you mean {rated['task']}?" in done.stderr, done.stderr
    if rated["concurrency"] is None:
        done = baton(workers, "limits", "set", rated["task"], "--concurrency", "2", app=app)
        assert done.returncode == 2 and "declares no global_concurrency" in done.stderr


def test_commands_know_the_tasks_an_app_includes(workers: Workers) -> None:
    """Tasks in a module of `include=` (Celery's own layout): before, `limits` said "no
    task has a global limit" and `unlock --task` refused the task's full name."""
    app = "tests.apps.included"
    name = "tests.apps.included_tasks.fetch"
    listing = as_json(workers, "limits", app=app)
    assert [t["task"] for t in listing["tasks"]] == [name], listing
    done = baton(workers, "unlock", "--task", name, app=app)
    assert done.returncode == 0 and "no lease or unique claim" in done.stdout, done.stderr
    done = baton(workers, "unlock", "--task", "fetch", app=app)
    assert done.returncode == 2 and f"did you mean {name}" in done.stderr, done.stderr


@pytest.mark.timeout(120)  # ~15-30 s here; 60 s is the default
def test_watch_prints_again_until_interrupted(workers: Workers) -> None:
    # Unbuffered, so that the frames are read as they come; the fault handler, so that a
    # process that does not stop on Ctrl-C shows where it is (SIGABRT below).
    env = {**_process_env(workers.env), "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", APP, "baton", "status", "--watch", "0.3"],
        env=env,
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # As from a terminal: a test run started in the background of a shell without job
        # control ignores SIGINT, and a process keeps an ignored SIGINT ignored (as
        # Python does: a background job is not interrupted by Ctrl-C).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    frames, out = 0, ""
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 60
        while frames < 2 and time.monotonic() < deadline:  # printed again: it watches
            line = proc.stdout.readline()
            if not line:
                break
            out += line
            frames += line.startswith("store:")
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            rest, err = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)  # the fault handler prints every thread's stack
            rest, err = proc.communicate(timeout=20)
            pytest.fail(f"status --watch went on after Ctrl-C; its threads:\n{err[-6000:]}")
    assert frames >= 2, out + rest + err
    assert proc.returncode == 0, err


def test_status_never_starts_an_embedded_server(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATON_")}
    env.update(XDG_RUNTIME_DIR=str(tmp_path), TMPDIR=str(tmp_path))
    # A broker on this machine that is not Redis: with no store URL, the embedded store
    # (a Redis broker's server would be the store).
    env["TEST_BROKER_URL"] = "amqp://guest:guest@127.0.0.1:1//"
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.apps.no_baton", "baton", "status"],
        env=_process_env(env),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    started = list(tmp_path.rglob("valkey.pid"))
    for pidfile in started:  # never leave a daemon behind, even when this test fails
        with contextlib.suppress(ValueError, OSError):
            os.kill(int(pidfile.read_text().strip()), signal.SIGKILL)
    assert done.returncode != 0 and "no embedded store runs" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert not started, "status started an embedded server"


@pytest.mark.timeout(120)
def test_a_killed_holder_is_stale_within_seconds_even_with_a_long_lease_ttl(
    workers: Workers, observer: Observer
) -> None:
    """An operator must tell a dead holder from a live one before reaching for --force:
    the lease lives on for its lease_ttl (60 s here), but it is marked STALE, and the
    dead worker leaves `status`, within seconds of a SIGKILL (issue 28 §1)."""
    from tests.apps.exclusive import ex_skip

    env = {"BATON_TEST_APP_LEASE_TTL": "60", "BATON_TEST_LEASE_TTL": "60"}
    # The test's store started less than 60 s ago: no grace, no worker ran before it.
    # (The command reads the workers' lease_ttl, as an operator's does, to tell a grace.)
    assert baton(workers, "end-grace", env=env).returncode == 0
    worker = workers.start(APP, concurrency=1, env=env)
    ex_skip.delay("stale-60", 120.0)
    observer.starts_of("stale-60")
    [live] = as_json(workers, "locks")
    assert live["stale"] is False and live["ttl_left"] > 30, live
    assert [w["hostname"] for w in as_json(workers, "status")["workers"]] == [worker.hostname]
    worker.kill()
    killed = time.monotonic()
    # Seen stale within REPORT_TTL (5 s) of the kill; judged within 30 s, as each look
    # is a CLI process of its own (seconds apiece on a loaded machine), and still long
    # before the lease's own 60 s run out (asserted below).
    wait_until(
        lambda: as_json(workers, "locks")[0]["stale"] is True,
        timeout=30,
        what="the lease of a SIGKILLed worker marked stale",
    )
    wait_until(
        lambda: as_json(workers, "status")["workers"] == [],
        timeout=max(1.0, 30 - (time.monotonic() - killed)),
        what="the SIGKILLed worker gone from status",
    )
    [lock] = as_json(workers, "locks")
    assert lock["ttl_left"] > 0, lock  # the lease itself still lives: only seen as dead
    assert as_json(workers, "status")["stale_leases"] == 1


def test_locks_and_unlock_say_the_key_in_words(workers: Workers, observer: Observer) -> None:
    """A stored key is a digest; beside it the operator reads the arguments it was built
    from, bounded in length (issue 28 §2)."""
    from tests.apps.exclusive import ex_skip

    worker = workers.start(APP, concurrency=1)
    long_value = "https://feeds.example.org/" + "x" * 500
    ex_skip.delay(long_value, 40.0)
    observer.starts_of(long_value)

    def labelled() -> Any:
        rows = as_json(workers, "locks")
        return rows if rows and rows[0].get("label") else None

    wait_until(labelled, timeout=10, what="the lease's key in words")
    [row] = as_json(workers, "locks")
    assert row["label"].startswith("ex_skip(key='https://feeds.example.org/xxx"), row
    assert row["label"].endswith("…')") and len(row["label"]) < 200, row
    text = baton(workers, "locks").stdout
    assert row["key"] in text.splitlines() and row["label"] in text, text
    refused = baton(workers, "unlock", row["key"])
    assert refused.returncode != 0 and row["label"] in refused.stderr, refused.stderr
    forced = baton(workers, "unlock", row["key"], "--force")
    assert forced.returncode == 0 and row["label"] in forced.stdout, forced.stdout
    worker.kill()


def test_under_json_an_error_is_json_too(workers: Workers) -> None:
    """A script that asked for JSON gets JSON when a command fails (issue 28 §3)."""
    key = "baton:{tests.apps.exclusive.ex_skip}:ex:nothing"
    for args in (("--json", "unlock", key), ("unlock", key, "--json")):
        done = baton(workers, *args)
        assert done.returncode == 1, done
        error = json.loads(done.stdout)["error"]
        assert "no such lease" in error, done.stdout
    usage = baton(workers, "limits", "set", "nodots", "--rate", "5/s", "--json")
    assert usage.returncode == 2, usage
    assert "not a full task name" in json.loads(usage.stdout)["error"], usage.stdout
    assert "Traceback" not in usage.stderr


def test_a_beat_slots_lease_is_named_a_beat_slot_not_redelivery(
    workers: Workers, observer: Observer
) -> None:
    """With the redelivery guard off, the lease that makes a beat slot run once is the
    slot's, not the guard's: `locks` says so, with the entry and slot in words (issue 28
    §10). The message is sent as the beat sends one (its slot header)."""
    from celery_baton.core.policy.headers import BEAT_SLOT_HEADER
    from tests.apps.exclusive import ex_skip

    worker = workers.start(APP, concurrency=1)
    slot_ms = 1_795_000_000_000  # 2026-11-18T11:06:40Z
    headers = {BEAT_SLOT_HEADER: slot_ms, "baton_beat_entry": "every-minute"}
    ex_skip.apply_async(("slot", 40.0), headers=headers)
    observer.starts_of("slot")

    def slot_rows() -> list[Any]:
        rows = as_json(workers, "locks")
        return [r for r in rows if ":run:" in r["key"] and r.get("label")]

    wait_until(slot_rows, timeout=10, what="the slot's lease in words")
    [row] = slot_rows()
    assert row["kind"] == "beat slot", row
    assert row["label"] == "ex_skip: beat entry 'every-minute', slot 2026-11-18T11:06:40Z", row
    text = baton(workers, "locks").stdout
    assert "beat slot  task" in text and "redelivery" not in text, text
    worker.kill()
