"""A worker whose tasks declare celery-baton options on an app without ``Baton(app)``
says so at start, naming the tasks (issue 13 §2): ``unique`` must not be a silent no-op."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support.processes import REPO_ROOT
from tests.support.servers import StoreServer
from tests.support.waiting import wait_until
from tests.support.workers import Workers


def _with_repo(env: dict[str, str]) -> dict[str, str]:
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = f"{REPO_ROOT}{os.pathsep}{path}" if path else str(REPO_ROOT)
    return env


def test_options_on_an_app_without_baton_are_a_warning_naming_the_task(
    workers: Workers,
) -> None:
    worker = workers.start("tests.apps.no_baton", concurrency=1)
    wait_until(
        lambda: "Baton(app) was never called" in worker.log_text(), timeout=20, what="warning"
    )
    assert "tests.apps.no_baton.build_report" in worker.log_text()


def test_a_database_the_store_does_not_have_stops_the_worker_naming_baton_url(
    workers: Workers, store_server: StoreServer
) -> None:
    """``redis://host/99`` on a server with 16 databases: every command fails. The worker
    took that for a store that is down and held its guarded tasks forever; it is a wrong
    URL, said at start (issue 13 §2)."""
    worker = workers.start(
        "tests.apps.exclusive", env={"BATON_URL": store_server.url(99)}, wait=False
    )
    wait_until(lambda: not worker.is_running, timeout=30, what="the worker to exit")
    log = worker.log_text()
    assert worker.returncode != 0
    assert "baton_url" in log and "no database 99" in log, worker.log_tail()


def test_a_missing_database_is_one_line_from_the_cli(
    store_server: StoreServer, store_url: str
) -> None:
    env = dict(os.environ, BATON_URL=store_server.url(99))
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.apps.exclusive", "baton", "status"],
        env=_with_repo(env),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
    )
    assert done.returncode != 0
    assert "no database 99" in done.stderr + done.stdout
    assert "Traceback" not in done.stderr, done.stderr


def test_the_worker_names_its_store_and_its_guarded_tasks_at_start(
    workers: Workers, store_url: str
) -> None:
    """Beat's banner names its store; the worker's said nothing of celery-baton, even at
    Celery's default log level (issue 39 §2)."""
    from tests.apps import exclusive

    # The app module's own tasks: this test process may hold shared tasks of other test
    # apps it imported (they join every app), which the worker never imports.
    guarded = [
        name
        for name, task in exclusive.app.tasks.items()
        if name.startswith("tests.apps.exclusive.") and exclusive.baton.policy_for(task) is not None
    ]
    worker = workers.start("tests.apps.exclusive", concurrency=1, loglevel="WARNING", wait=False)
    wait_until(lambda: ".> baton:" in worker.log_text(), timeout=30, what="the baton line")
    line = next(text for text in worker.log_text().splitlines() if ".> baton:" in text)
    assert store_url in line, line
    assert "role worker" in line and f"{len(guarded)} guarded tasks" in line, line


def test_the_worker_counts_celerys_own_tasks_apart_under_an_app_wide_guard(
    workers: Workers,
) -> None:
    """``baton_redelivery_guard = True`` guards Celery's own tasks too (chord_unlock,
    the canvas helpers): the banner counted them as the user's (18 for 9 tasks)."""
    from tests.apps import republish

    own = [name for name in republish.app.tasks if name.startswith("tests.apps.republish.")]
    worker = workers.start("tests.apps.republish", concurrency=1, loglevel="WARNING", wait=False)
    wait_until(lambda: ".> baton:" in worker.log_text(), timeout=30, what="the baton line")
    line = next(text for text in worker.log_text().splitlines() if ".> baton:" in text)
    assert f"{len(own)} guarded tasks (+" in line and "of Celery's own)" in line, line
