"""django-celery-beat's tables fired exactly once (``celery_baton.beat.django:DjangoScheduler``).

A real Django project (tests/apps/django_project) on SQLite, and on PostgreSQL when a
server answers on 127.0.0.1:5432; ``python -m django migrate`` creates the tables. Two
beats run as two "hosts" (:class:`Machine`: own ``TMPDIR``, ``XDG_RUNTIME_DIR``, working
directory, an environment of their own with only the URLs in common) beside one worker.
Edits are model saves in a process of their own, as the admin makes them. Every run is
counted from the worker side (``<entry>|<slot>``, the slot from the message header).
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from celery_baton.beat.state import BeatKeys
from tests.beat.helpers import runs_per_slot, wait_for_slots
from tests.beat.test_processes import assert_each_slot_once, drain
from tests.support.celery_processes import BeatProcess, start_beat
from tests.support.machine import Machine
from tests.support.observer import Observer
from tests.support.processes import REPO_ROOT
from tests.support.servers import StoreServer
from tests.support.workers import Workers

if importlib.util.find_spec("django_celery_beat") is None:
    pytest.skip(
        "django-celery-beat is not installed (pip install -e '.[test]' installs it)",
        allow_module_level=True,
    )

APP = "tests.apps.django_project.celery_app"
KEYS = BeatKeys(app="djbeat")
PG_DATABASE = "test"  # the server's database we connect to, to create our own


def _postgres_answers() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 5432), timeout=1):
            return True
    except OSError:
        return False


@pytest.fixture(params=["sqlite", "postgresql"])
def database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """``DJBEAT_DB`` of the project: a fresh SQLite file, or a fresh PostgreSQL database."""
    if request.param == "sqlite":
        yield f"sqlite:{tmp_path / 'db.sqlite3'}"
        return
    if not _postgres_answers():
        pytest.skip("PostgreSQL does not answer on 127.0.0.1:5432 (user postgres, trust auth)")
    psycopg = pytest.importorskip("psycopg", reason="psycopg is not installed")
    name = f"djbeat_{secrets.token_hex(4)}"
    with psycopg.connect(f"host=127.0.0.1 user=postgres dbname={PG_DATABASE}") as conn:
        conn.autocommit = True
        conn.execute(f"CREATE DATABASE {name}")
    yield f"postgresql:{name}"
    with psycopg.connect(f"host=127.0.0.1 user=postgres dbname={PG_DATABASE}") as conn:
        conn.autocommit = True
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture
def project(
    database: str, store_url: str, broker_url: str, result_url: str, broker_server: StoreServer
) -> dict[str, str]:
    """The project's environment, its tables migrated; nothing of this host's but PATH."""
    env = {
        "PATH": os.environ["PATH"],
        "DJANGO_SETTINGS_MODULE": "tests.apps.django_project.settings",
        "DJBEAT_DB": database,
        "BATON_URL": store_url,
        "TEST_BROKER_URL": broker_url,
        "TEST_RESULT_URL": result_url,
        "TEST_OBSERVER_URL": broker_server.url(2),
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p
        ),
    }
    done = subprocess.run(
        [sys.executable, "-m", "django", "migrate", "--noinput"],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return env


def edit(env: dict[str, str], changes: list[dict[str, object]]) -> dict[str, dict[str, object]]:
    """Apply ``changes`` as model saves (tests/apps/django_project/edit.py); every row."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.apps.django_project.edit", json.dumps(changes)],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    rows: dict[str, dict[str, object]] = json.loads(done.stdout.splitlines()[-1])
    return rows


@pytest.fixture
def hosts() -> Iterator[list[Machine]]:
    roots = [Path(tempfile.mkdtemp(prefix="dj", dir="/tmp")) for _ in range(2)]
    yield [Machine(root) for root in roots]
    for root in roots:
        shutil.rmtree(root, ignore_errors=True)


def start_beats(
    workers: Workers, project: dict[str, str], hosts: list[Machine], **extra: str
) -> list[BeatProcess]:
    beats = []
    for host in hosts:
        env = {**project, **host.env, **extra}
        beat = start_beat(APP, env=env, cwd=host.cwd, log_dir=host.root)
        workers.started.append(beat)
        beats.append(beat)
    for beat in beats:
        beat.wait_started()
    return beats


def leader(store: redis.Redis, beats: list[BeatProcess], not_pid: int = 0) -> BeatProcess:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        owner = store.hget(KEYS.leader, "owner")
        pid = int(str(owner).split(":")[1]) if owner else 0
        for beat in beats:
            if pid == beat.pid and pid != not_pid and beat.is_running:
                return beat
        time.sleep(0.05)
    raise AssertionError("no beat leads after 30 s")


def ms_now() -> int:
    return round(time.time() * 1000)


@pytest.mark.timeout(150)
def test_two_hosts_leader_killed_each_slot_once_and_runs_written(
    workers: Workers,
    observer: Observer,
    store: redis.Redis,
    project: dict[str, str],
    hosts: list[Machine],
) -> None:
    # Each slot runs, caught up across the failover (baton_misfire="all"; the default
    # coalesces late slots: tests/beat/test_late_slots.py).
    catch_up = json.dumps({"baton_misfire": "all"})
    edit(project, [{"name": "every1", "every": 1, "fields": {"headers": catch_up}}])
    settings = {"DJBEAT_SETTINGS_ENTRIES": json.dumps({"settings2": 2})}
    settings["DJBEAT_SETTINGS_OPTIONS"] = catch_up
    workers.start(APP, env={**project, **settings})
    beats = start_beats(workers, project, hosts, **settings)
    first = leader(store, beats)
    wait_for_slots(observer, "every1", 6, timeout=30)  # the first leader fires
    first.kill()
    killed = time.monotonic()
    killed_ms = int(time.time() * 1000)
    second = leader(store, beats, not_pid=first.pid)
    failover = time.monotonic() - killed
    # The second leader fires (the slots it took over and new ones), up to the counts below.
    wait_for_slots(observer, "every1", 14, timeout=60)
    wait_for_slots(observer, "settings2", 7, timeout=60)
    wait_for_slots(observer, "every1", 3, after_ms=killed_ms, timeout=30)
    second.stop()
    drain(observer)

    assert_each_slot_once(observer, "every1", 1000, at_least=14)
    assert_each_slot_once(observer, "settings2", 2000, at_least=7)
    assert failover < 12, failover
    rows = edit(project, [])
    assert "settings2" not in rows, "a beat_schedule entry was written to the tables"
    ran = sorted(runs_per_slot(observer, "every1"))
    count = rows["every1"]["total_run_count"]
    # A beat killed or stopped between a publish and its write leaves the count one short.
    assert isinstance(count, int) and len(ran) - 2 <= count <= len(ran), (count, len(ran))
    assert rows["every1"]["last_run_at"] in ran[-2:], (rows["every1"], ran[-3:])
    assert "leading the schedule" in second.log_text()


@pytest.mark.timeout(150)
def test_admin_edits_are_picked_up_within_seconds(
    workers: Workers,
    observer: Observer,
    store: redis.Redis,
    project: dict[str, str],
    hosts: list[Machine],
) -> None:
    t0 = ms_now()
    minute = 60_000
    ran_at = (t0 - 3 * minute) // minute * minute  # seed 001: it ran at :m0, 3 min ago
    edited_to = (t0 - minute) // minute * minute  # ... and is moved to :m1, 1 min ago
    edit(
        project,
        [
            {"name": "every2", "every": 2},
            {"name": "to_disable", "every": 1},
            {
                "name": "seed001",
                "cron": {"minute": time.gmtime(ran_at / 1000).tm_min},
                "fields": {"last_run_at": ran_at},
            },
        ],
    )
    workers.start(APP, env=project)
    start_beats(workers, project, hosts)
    leader(store, [b for b in workers.started if isinstance(b, BeatProcess)])
    time.sleep(7)
    clocked_at = ms_now() + 4000
    # The edit's save lands before its process ends: a beat may pick it up before then
    # (a loaded machine saw the new interval's first slot before ``edited``).
    editing = ms_now()
    edit(
        project,
        [
            {"name": "every2", "every": 1},
            {"name": "to_disable", "fields": {"enabled": False}},
            {"name": "added", "every": 1},
            {"name": "seed001", "cron": {"minute": time.gmtime(edited_to / 1000).tm_min}},
            {"name": "clocked", "clocked": clocked_at},
        ],
    )
    edited = ms_now()
    time.sleep(9)
    for beat in workers.started:
        if isinstance(beat, BeatProcess):
            beat.stop()
    drain(observer)
    rows = edit(project, [])
    logs = "".join(b.log_text() for b in workers.started if isinstance(b, BeatProcess))
    assert "django-celery-beat's schedule changed; reading it" in logs

    pickup = 5000  # poll (2 s) + an interval (1 s) + a loaded machine's margin
    every2 = sorted(runs_per_slot(observer, "every2"))
    before = [s for s in every2 if s < editing]
    after = [s for s in every2 if s > edited + pickup]
    assert {b - a for a, b in itertools.pairwise(before)} == {2000}, before
    # The new interval, 1 s. A beat late by a second (a machine's stall: 2.2 s without a
    # send in a CI run) coalesces the late slot into the next one, the default misfire,
    # and says so in its log: a gap of 2 s then, never the old interval throughout.
    gaps = [b - a for a, b in itertools.pairwise(after)]
    assert gaps and all(g % 1000 == 0 for g in gaps), after
    assert sum(g == 1000 for g in gaps) >= 2 * len(gaps) // 3, after
    if any(g > 1000 for g in gaps):
        assert "coalesced into one run" in logs, after
    # The edit moves the next slot to the first after now (or the last run + 1 s): no
    # burst, and no gap beyond the old interval's next slot (+ the new interval).
    switch = min(s for s in every2 if s > before[-1]) - before[-1]
    assert 1000 <= switch <= 2000 + 1000 + 500, switch
    assert all(n == 1 for n in runs_per_slot(observer, "every2").values())

    assert max(runs_per_slot(observer, "to_disable")) < edited + pickup
    added = runs_per_slot(observer, "added")
    assert min(added) < edited + pickup and len(added) >= 4
    assert all(n == 1 for n in added.values())

    # Seed 001: moved between its last run and now, it does not fire at once; its next
    # slot is the new minute's next hour.
    assert not runs_per_slot(observer, "seed001")
    assert int(store.hget(KEYS.entry("seed001"), "next") or 0) == edited_to + 3600_000

    assert dict(runs_per_slot(observer, "clocked")) == {clocked_at: 1}
    assert rows["clocked"]["enabled"] is False
    assert rows["to_disable"]["enabled"] is False
    assert not store.exists(KEYS.entry("to_disable"))
    assert rows["added"]["total_run_count"] in (len(added), len(added) - 1)


@pytest.mark.timeout(200)
def test_a_slot_the_killed_leader_claimed_is_written_by_the_leader_that_sends_it(
    workers: Workers,
    observer: Observer,
    store: redis.Redis,
    project: dict[str, str],
    hosts: list[Machine],
    tmp_path: Path,
) -> None:
    """The leader SIGKILLed right after it claimed a crontab slot (before it sent it):
    the next leader re-sends the slot and writes the row's ``last_run_at`` and
    ``total_run_count``. Before, the row said it never ran (4 of 15 runs of issue 35)."""
    edit(project, [{"name": "minutely", "cron": {"minute": "*"}}])
    marker = tmp_path / "killed"
    workers.start(APP, env=project)
    beats = start_beats(
        workers,
        project,
        hosts,
        DJBEAT_SCHEDULER="tests.apps.django_project.killed_after_claim:Scheduler",
        DJBEAT_KILL_AFTER_CLAIM=f"minutely:{marker}",
    )
    leader(store, beats)
    # The next minute's slot, claimed by whichever beat leads then (on a loaded machine
    # the lead may have moved before the minute): it dies as it claims.
    deadline = time.monotonic() + 80
    while not marker.exists() or all(b.is_running for b in beats):
        assert time.monotonic() < deadline, "no leader claimed the minute's slot: " + "".join(
            b.log_tail() for b in beats
        )
        time.sleep(0.1)
    first = next(b for b in beats if not b.is_running)
    second = leader(store, beats, not_pid=first.pid)
    wait_for_slots(observer, "minutely", 1, timeout=40)
    slot = min(runs_per_slot(observer, "minutely"))
    assert "re-sending 'minutely'" in second.log_text(), second.log_tail()
    deadline = time.monotonic() + 20
    while (row := edit(project, [])["minutely"])["total_run_count"] != 1:
        assert time.monotonic() < deadline, f"the re-sent slot {slot} left the row {row}"
        time.sleep(1)
    assert row["last_run_at"] == slot, (row, slot)
    assert runs_per_slot(observer, "minutely")[slot] == 1
    # Who leads, in each beat's log: the one that took over named the killed one while
    # it stood by, and names itself as it leads.
    lines = second.log_text().splitlines()
    assert any("standing by;" in x and f":{first.pid}:" in x for x in lines), lines[:20]
    assert any("leading the schedule" in x and f":{second.pid}:" in x for x in lines)
