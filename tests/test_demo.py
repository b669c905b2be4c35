"""The README's first command, run as a user would: `python -m celery_baton demo`."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.processes import REPO_ROOT


@pytest.mark.timeout(120)  # ~15-30 s here; 60 s is the default
def _user_env() -> dict[str, str]:
    """The environment as a user has it: none of the tests' settings."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("BATON_", "TEST_"))}


def _demo(*args: str) -> str:
    """``python -m celery_baton demo`` as a user runs it: what it printed, once it
    passed."""
    done = subprocess.run(
        [sys.executable, "-m", "celery_baton", "demo", *args],
        cwd=REPO_ROOT,
        env=_user_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_the_demo_holds_every_guarantee_on_the_embedded_store() -> None:
    out = _demo()
    assert "all guarantees held" in out
    for guarantee in ("exclusive", "unique", "rate", "concurrency", "beat", "redelivery"):
        assert f"{guarantee}:" in out
    assert "beat: ticks fired / duplicates" in out and " / 0 " in out
    # Its folder (server data, the processes' logs) goes with a run that passed.
    folder = _demo_folder(out)
    assert not folder.exists(), f"{folder} left behind"


def _demo_folder(out: str) -> Path:
    """The demo's own folder, from its line naming its store's socket in it."""
    found = re.search(r"embedded Valkey on (\S+)", out)
    assert found, out[-2000:]
    return next(p for p in Path(found.group(1)).parents if p.name.startswith("baton-demo-"))


@pytest.mark.timeout(120)
def test_a_store_kept_by_the_demo_is_named_with_how_to_stop_it() -> None:
    """``--keep-store``: the server stays, and the demo says where and how to stop it
    (before: nothing was said, and ``stop-embedded`` answered "not running")."""
    out = _demo("--keep-store")
    said = re.search(
        r"stop it with (BATON_RUNTIME_DIR=(\S+)) python -m celery_baton stop-embedded", out
    )
    assert said, out[-2000:]
    folder = Path(said.group(2))
    stop = subprocess.run(
        [sys.executable, "-m", "celery_baton", "stop-embedded"],
        cwd=REPO_ROOT,
        env={**_user_env(), "BATON_RUNTIME_DIR": str(folder)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert stop.stdout.strip() == "stopped", stop.stdout + stop.stderr
    shutil.rmtree(folder, ignore_errors=True)


def test_a_process_that_dies_is_reported_with_its_own_error(tmp_path: object) -> None:
    """The fresh-install failure: kombu's Redis transport needs ``packaging``. Here it is
    made unimportable in the demo's processes; the demo must print the worker's error,
    not just "see logs"."""
    from pathlib import Path

    shadow = Path(str(tmp_path)) / "packaging"
    shadow.mkdir()
    (shadow / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'packaging'\")\n"
    )
    env = _user_env()
    env["PYTHONPATH"] = str(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "celery_baton", "demo"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    assert "worker1 died" in done.stdout or "worker2 died" in done.stdout, done.stdout
    assert "ModuleNotFoundError: No module named 'packaging'" in done.stdout, done.stdout


def test_the_demo_explains_itself() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "celery_baton", "demo", "--help"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0
    assert "Ctrl-C" in done.stdout and "embedded" in done.stdout


def test_the_cli_refuses_a_bad_store_url_in_one_line() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATON_")}
    env.update(TEST_BROKER_URL="redis://127.0.0.1:1/0", TEST_GIVEN_STORE_URL="127.0.0.1:6379")
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.apps.url_given", "baton", "status"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr
    assert "baton_url:" in done.stderr and "no scheme" in done.stderr, done.stderr
