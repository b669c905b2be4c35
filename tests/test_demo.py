"""The README's first command, run as a user would: `python -m celery_baton demo`."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support.processes import REPO_ROOT


def test_the_demo_holds_every_guarantee_on_the_embedded_store() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BATON_", "TEST_"))}
    done = subprocess.run(
        [sys.executable, "-m", "celery_baton", "demo"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "all guarantees held" in out
    for guarantee in ("exclusive", "rate", "concurrency", "beat", "redelivery"):
        assert f"{guarantee}:" in out
    assert "beat: ticks fired / duplicates" in out and " / 0 " in out


def test_the_demo_explains_itself() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "celery_baton", "demo", "--help"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0
    assert "Ctrl-C" in done.stdout and "embedded" in done.stdout
