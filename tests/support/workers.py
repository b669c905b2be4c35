"""The ``workers`` fixture's class: starts real ``celery worker`` and ``celery beat``
processes with the test's URLs, and ends them.

The process handles, and how one is started without the fixture, are in
:mod:`tests.support.celery_processes`; a stand-in for another machine is
:class:`tests.support.machine.Machine`.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.support import processes
from tests.support.celery_processes import (
    BeatProcess,
    WorkerProcess,
    _CeleryProcess,
    start_beat,
    start_worker,
)


class Workers:
    """The ``workers`` fixture: starts workers and beats with the test's URLs, and ends them.

    Example::

        def test_something(workers, observer):
            w1 = workers.start()                          # tests.apps.basic, waits for ready
            w2 = workers.start("tests.apps.basic", concurrency=1, wait=False)
            w2.wait_ready()
            beat = workers.start_beat("tests.apps.basic", scheduler="...")

    Everything started is ended at teardown (see :meth:`end_all`: SIGKILL after a test
    that passed; SIGTERM, then SIGKILL after 15 s, after one that failed, and the tail
    of each log is printed).
    """

    def __init__(self, env: dict[str, str], log_dir: Path) -> None:
        #: The environment every process gets (see :func:`app_env`).
        self.env = env
        self.log_dir = log_dir
        #: Every process started, in order.
        self.started: list[_CeleryProcess] = []

    def start(
        self,
        app: str = "tests.apps.basic",
        *,
        env: dict[str, str] | None = None,
        wait: bool = True,
        **kw: Any,
    ) -> WorkerProcess:
        """:func:`start_worker` with the test's env (``env`` entries added on top).

        Waits for ready unless ``wait=False``. ``kw`` goes to :func:`start_worker`.
        """
        worker = start_worker(app, env=self._env(env), log_dir=self.log_dir, **kw)
        self.started.append(worker)
        if wait:
            worker.wait_ready()
        return worker

    def start_beat(
        self,
        app: str = "tests.apps.basic",
        *,
        env: dict[str, str] | None = None,
        wait: bool = True,
        **kw: Any,
    ) -> BeatProcess:
        """:func:`start_beat` with the test's env; waits for started unless ``wait=False``."""
        beat = start_beat(app, env=self._env(env), log_dir=self.log_dir, **kw)
        self.started.append(beat)
        if wait:
            beat.wait_started()
        return beat

    def _env(self, extra: dict[str, str] | None) -> dict[str, str]:
        env = {**self.env, **(extra or {})}
        # A variable set to "" means "unset it" (a Machine has no $BATON_URL).
        return {name: value for name, value in env.items() if value != ""}

    def stop_all(self, timeout: float = 15) -> None:
        """Stop every process still running: SIGTERM to all at once, SIGKILL after ``timeout`` s."""
        for process in self.started:
            processes.signal_quietly(process._proc, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for process in self.started:
            process._end(max(0.0, deadline - time.monotonic()), sigterm=False)

    def kill_all(self) -> None:
        """SIGKILL every process (and its pool) still running: the end of a test that
        passed. Its assertions are made; a warm shutdown would only cost Celery's prefork
        pool its ~2.5 s (its handler threads poll once a second), for every test."""
        for process in self.started:
            if process.returncode is None:
                process.kill()

    def end_all(self, *, passed: bool) -> None:
        """At teardown: a test that failed shows its processes' shutdown in their logs
        (:meth:`stop_all`); one that passed is ended at once (:meth:`kill_all`)."""
        if passed:
            self.kill_all()
        else:
            self.stop_all(timeout=15)

    def stacks(self) -> str:
        """Where every process still running, and each of its pool processes, is now
        (``py-spy dump``; nothing without py-spy): a failed test's hang shows its place
        before the shutdown moves it."""
        beside = Path(sys.executable).parent / "py-spy"
        spy = str(beside) if beside.exists() else shutil.which("py-spy")
        if spy is None:
            return ""
        parts = []
        for process in self.started:
            if process.returncode is not None:
                continue
            for pid in [process._proc.pid, *_children(process._proc.pid)]:
                try:
                    dump = subprocess.run(
                        [spy, "dump", "--pid", str(pid)],
                        capture_output=True,
                        text=True,
                        timeout=20,
                    )
                    parts.append(
                        f"----- stacks of pid {pid} ({process!r}) -----\n{dump.stdout}{dump.stderr}"
                    )
                except (OSError, subprocess.SubprocessError) as exc:
                    parts.append(f"----- stacks of pid {pid}: {exc!r}")
        return "\n".join(parts)

    def report(self, lines: int = 150) -> str:
        """The tail of every process's log, for a failed test's output."""
        parts = [
            f"----- {process!r} ({process.log_path}) -----\n{process.log_tail(lines)}"
            for process in self.started
        ]
        return "\n".join(parts)


def _children(pid: int) -> list[int]:
    """The pids whose parent is ``pid`` (a worker's pool processes), from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces; the fields follow its ")".
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 1 and fields[1] == str(pid):
            found.append(int(entry.name))
    return found
