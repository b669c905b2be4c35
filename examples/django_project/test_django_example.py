"""The Django example on a real server and a real worker.

Proves that celery-baton reads ``CELERY_BATON_URL`` through Celery's ``CELERY``
namespace, that an exclusive task declared in a Django app with ``@shared_task``
runs once while its duplicate is skipped, and that two beats fire a django-celery-beat
row once per slot (``celery_baton.beat.django:DjangoScheduler``). Run from the repository root::

    python -m pytest examples/django_project
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_baton import TaskSkipped
from celery_baton.store import inspect as store_inspect
from tests.support.servers import StoreServer
from tests.support.workers import WorkerProcess, start_beat, start_worker

if importlib.util.find_spec("django_celery_beat") is None:
    pytest.skip(
        "django-celery-beat is not installed (the project's beat uses it; pip install -e "
        "'.[test]' installs it)",
        allow_module_level=True,
    )

HERE = Path(__file__).resolve().parent
FEED = "https://example.org/rss"


@pytest.fixture(scope="module")
def server() -> Iterator[StoreServer]:
    store = StoreServer(persistent=False, name="django-example")
    store.start()
    yield store
    store.close()


@pytest.fixture(scope="module")
def env(server: StoreServer) -> Iterator[dict[str, str]]:
    """The project's settings come from these variables (see proj/settings.py)."""
    values = {
        "DJANGO_SETTINGS_MODULE": "proj.settings",
        "CELERY_BROKER_URL": server.url(0),
        "CELERY_RESULT_BACKEND": server.url(1),
        "CELERY_BATON_URL": server.url(2),
    }
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("BATON_URL", raising=False)  # the namespace alone must provide the URL
        for name, value in values.items():
            mp.setenv(name, value)
        mp.syspath_prepend(str(HERE))
        yield {**os.environ, "PYTHONPATH": str(HERE)}


@pytest.fixture(scope="module")
def project(env: dict[str, str]) -> Any:
    """``proj.celery``, imported after the environment is set."""
    return importlib.import_module("proj.celery")


@pytest.fixture(scope="module")
def worker(
    env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    process = start_worker(
        "proj", env=env, concurrency=2, log_dir=tmp_path_factory.mktemp("django-worker")
    )
    try:
        process.wait_ready(timeout=30)
        yield process
    finally:
        process.stop(timeout=10)


def wait_until_no_leases(baton: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while store_inspect.leases(baton.store, baton.names.prefix):
        assert time.monotonic() < deadline, "the exclusive key was not released"
        time.sleep(0.02)


def test_baton_reads_celery_baton_url_through_the_namespace(
    project: Any, server: StoreServer
) -> None:
    assert project.app.conf.baton_url == server.url(2)
    assert project.baton.settings.url == server.url(2)
    assert project.baton.settings.lease_ttl == 15.0  # CELERY_BATON_LEASE_TTL


def test_the_cli_finds_the_store_through_django_settings(
    env: dict[str, str], server: StoreServer
) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "proj", "baton", "--json", "status"],
        cwd=HERE,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    assert json.loads(out)["store"] == server.url(2)


@pytest.mark.timeout(120)  # ~15-30 s here; 60 s is the default
def test_exclusive_shared_task_runs_once_and_skips_the_duplicate(
    project: Any, worker: WorkerProcess
) -> None:
    importlib.import_module("feeds.tasks")
    # The app's own task, not the shared_task proxy: another app may be current here.
    import_feed = project.app.tasks["feeds.tasks.import_feed"]

    first, second = import_feed.delay(FEED, 2.0), import_feed.delay(FEED, 2.0)
    for result in (first, second):
        result.get(timeout=20, propagate=False)
    ran, skipped = (first, second) if first.successful() else (second, first)

    assert ran.successful(), worker.log_tail()
    assert skipped.failed(), worker.log_tail()
    assert isinstance(skipped.result, TaskSkipped)
    assert skipped.result.holder == ran.id
    assert ran.result["fence"] > 0

    # The worker's main process frees the key just after the result is stored: wait for
    # it, then the next import runs, with a newer fence.
    wait_until_no_leases(project.baton)
    again = import_feed.delay(FEED, 0.1)
    assert again.get(timeout=20)["fence"] > ran.result["fence"]
    assert f"{skipped.id}] skipped" in worker.log_text()


def manage(env: dict[str, str], *args: str) -> str:
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=HERE,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout


@pytest.mark.timeout(120)
def test_two_beats_fire_a_periodic_task_row_once_per_slot(
    env: dict[str, str], worker: WorkerProcess, tmp_path: Path
) -> None:
    db_env = {**env, "DJANGO_DB_PATH": str(tmp_path / "db.sqlite3")}
    manage(db_env, "migrate", "--noinput")
    manage(
        db_env,
        "shell",
        "-c",
        "from django_celery_beat.models import IntervalSchedule, PeriodicTask\n"
        "every, _ = IntervalSchedule.objects.get_or_create(every=1, period='seconds')\n"
        "PeriodicTask.objects.create(name='poll', task='feeds.tasks.import_feed',"
        " interval=every, args='[\"https://example.org/beat\", 0.1]')",
    )
    beats = [start_beat("proj", env=db_env, cwd=HERE, log_dir=tmp_path) for _ in "ab"]
    count = "from django_celery_beat.models import PeriodicTask as P\n"
    count += "print(P.objects.get(name='poll').total_run_count)"
    try:
        deadline = time.monotonic() + 60
        while int(manage(db_env, "shell", "-c", count).split()[-1]) < 3:
            assert time.monotonic() < deadline, [b.log_tail() for b in beats]
            time.sleep(1)
        # Read while both run: stopping the leader first hands the lead to the other,
        # which then fires as it should; the test's own stop is not a second leader.
        logs = [b.log_text() for b in beats]
    finally:
        for beat in beats:
            beat.stop()
    sending = [text for text in logs if "Sending due task poll" in text]
    assert len(sending) == 1, "both beats fired the row"  # one leader all along
    assert "import_feed" in worker.log_text()
