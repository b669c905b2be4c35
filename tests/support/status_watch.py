"""``celery baton status --json --watch``, started once, read while a test goes on."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator

from tests.support.celery_processes import _process_env
from tests.support.processes import REPO_ROOT
from tests.support.waiting import wait_until


@contextlib.contextmanager
def status_watch(app: str, env: dict[str, str]) -> Iterator[Callable[[], str]]:
    """``celery -A app baton status --json --watch 0.2`` running, its imports done: yields
    what its reports said of the store's grace so far (joined). The grace lasts a few
    seconds, and a fresh ``celery`` process for each look took longer than that to start
    on a loaded machine (seen once in a CI rehearsal: "not within 20 s: grace in
    status", while the worker's log showed the grace)."""
    watcher = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", app, "baton", "status", "--json", "--watch", "0.2"],
        env=_process_env(env),
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    graces: list[str] = []

    def read() -> None:
        assert watcher.stdout is not None
        doc: list[str] = []
        for line in watcher.stdout:
            doc.append(line)
            if line.rstrip() == "}":  # the end of one report (json.dumps, indent 2)
                with contextlib.suppress(ValueError):
                    graces.append(str(json.loads("".join(doc)).get("grace")))
                doc = []

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        wait_until(lambda: graces or watcher.poll() is not None, 60, "a first status report")
        assert graces, f"celery baton status --watch exited {watcher.returncode}"
        yield lambda: " ".join(graces)
    finally:
        watcher.terminate()
        watcher.wait(timeout=10)
        reader.join(timeout=10)
        if watcher.stdout is not None:
            watcher.stdout.close()
