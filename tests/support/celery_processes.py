"""Real ``celery worker`` and ``celery beat`` processes for integration tests: the
handles (:class:`WorkerProcess`, :class:`BeatProcess`), how they are started
(:func:`start_worker`, :func:`start_beat`) and the environment they get (:func:`app_env`).

Example::

    env = app_env(store_url, broker_url, result_url, observer_url)
    worker = start_worker("tests.apps.basic", env=env, concurrency=2)
    worker.wait_ready()
    ...
    worker.kill()            # SIGKILL, as a crash would
    assert worker.stop() == 0  # (for a worker that was not killed) warm shutdown

In tests, prefer the ``workers`` fixture (:class:`tests.support.workers.Workers`), which
builds the env and stops whatever it started.

App modules read their URLs from the environment (see :func:`app_env`). Workers run
with ``cwd`` at the repository root and the root on ``PYTHONPATH``, so
``-A tests.apps.basic`` imports. Each process logs stdout and stderr to its own file.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import psutil

from tests.support import processes
from tests.support.processes import REPO_ROOT

_numbers = itertools.count(1)


def app_env(
    store_url: str, broker_url: str, result_url: str, observer_url: str, **extra: str
) -> dict[str, str]:
    """``os.environ`` plus the variables app modules read, plus ``extra``.

    ``BATON_URL`` (the store under test), ``TEST_BROKER_URL``, ``TEST_RESULT_URL`` and
    ``TEST_OBSERVER_URL``.
    """
    env = dict(os.environ)
    env.update(
        BATON_URL=store_url,
        TEST_BROKER_URL=broker_url,
        TEST_RESULT_URL=result_url,
        TEST_OBSERVER_URL=observer_url,
    )
    env.update(extra)
    return env


def _process_env(env: dict[str, str]) -> dict[str, str]:
    env = dict(env)
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = f"{REPO_ROOT}{os.pathsep}{path}" if path else str(REPO_ROOT)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _log_dir(log_dir: Path | None) -> Path:
    if log_dir is None:
        return Path(tempfile.mkdtemp(prefix="baton-celery-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    return log_dir


class _CeleryProcess:
    """What workers and beats share: a subprocess, its log, and how it ends."""

    kind = "process"

    def __init__(self, name: str, proc: subprocess.Popen[bytes], log_path: Path) -> None:
        self.name = name
        self.pid: int = proc.pid
        self.log_path = log_path
        self._proc = proc

    def __repr__(self) -> str:
        state = "running" if self.is_running else f"exited {self._proc.returncode}"
        return f"<{type(self).__name__} {self.name} pid={self.pid} {state}>"

    @property
    def is_running(self) -> bool:
        """True until the main process has exited."""
        return self._proc.poll() is None

    @property
    def returncode(self) -> int | None:
        """The exit code once exited (negative: killed by that signal), else ``None``."""
        return self._proc.poll()

    def log_text(self) -> str:
        """Everything the process wrote to stdout and stderr so far."""
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the log."""
        return processes.log_tail(self.log_path, lines)

    def stop(self, timeout: float = 20) -> int:
        """SIGTERM (warm shutdown: running tasks finish), wait ``timeout`` s, then SIGKILL.

        Returns the exit code (0 for a clean shutdown). Children still alive after the
        main process exited are killed.
        """
        return self._end(timeout, sigterm=True)

    def _end(self, timeout: float, *, sigterm: bool) -> int:
        children = self._children()
        code = processes.end(self._proc, timeout=timeout, sigterm=sigterm)
        _kill_all(children)
        return code

    def kill(self) -> None:
        """SIGKILL the main process, as a crash would; then SIGKILL its children.

        Children (the prefork pool) are recorded first, since once orphaned they are no
        longer findable from the main pid. To kill one pool child only (Celery then sees
        a ``WorkerLostError``), use ``os.kill(worker.pool_pids()[0], signal.SIGKILL)``.
        """
        children = self._children()
        processes.kill(self._proc)
        _kill_all(children)

    def _children(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def _wait_for_log(self, pattern: str, timeout: float, what: str) -> None:
        regex = re.compile(pattern, re.MULTILINE)
        deadline = time.monotonic() + timeout
        while True:
            if regex.search(self.log_text()):
                return
            if not self.is_running:
                raise RuntimeError(f"{self!r} exited before {what}; log tail:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self!r} not {what} after {timeout} s; log tail:\n{self.log_tail()}"
                )
            time.sleep(0.1)


def _kill_all(procs: Sequence[psutil.Process]) -> None:
    """SIGKILL ``procs`` and wait until each has exited. Exited is enough: an orphan's
    zombie (its files and sockets already closed) waits for its reaper, and waiting for
    that cost ~2 s every time."""
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 5
    for proc in procs:
        while time.monotonic() < deadline:
            try:
                if proc.status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.005)


class WorkerProcess(_CeleryProcess):
    """``python -m celery -A <app> worker`` as a real subprocess.

    ``hostname`` is the full node name (``w3-1a2b3c@myhost``), usable as a
    ``destination`` for ``app.control`` calls.
    """

    kind = "worker"

    def __init__(self, hostname: str, proc: subprocess.Popen[bytes], log_path: Path) -> None:
        super().__init__(hostname, proc, log_path)
        self.hostname = hostname

    def wait_ready(self, timeout: float = 60) -> None:
        """Wait until the log says ``<hostname> ready.`` (needs loglevel INFO or DEBUG).

        Raises ``RuntimeError`` with the log tail if the worker exits first, and
        ``TimeoutError`` after ``timeout`` seconds.
        """
        self._wait_for_log(rf"{re.escape(self.hostname)} ready\.", timeout, "ready")

    def pool_pids(self) -> list[int]:
        """Pids of the pool's child processes (prefork); ``[]`` for solo/threads pools."""
        try:
            return [child.pid for child in psutil.Process(self.pid).children()]
        except psutil.NoSuchProcess:
            return []


def start_worker(
    app: str,
    *,
    env: dict[str, str],
    hostname: str | None = None,
    concurrency: int = 2,
    pool: str = "prefork",
    queues: str | None = None,
    loglevel: str = "INFO",
    extra_args: Sequence[str] = (),
    prefetch_multiplier: int | None = None,
    log_dir: Path | None = None,
    cwd: Path | None = None,
    heartbeat: bool = False,
) -> WorkerProcess:
    """Start ``celery -A app worker`` without waiting; call :meth:`WorkerProcess.wait_ready`.

    ``env`` is the whole environment (build it with :func:`app_env`). ``hostname``
    defaults to a unique ``w<n>-<random>@<host>``; ``%h`` in it is expanded here.
    Mingle, gossip and heartbeats are off so that workers start fast (``heartbeat``:
    on, as by default, which also keeps the event dispatcher enabled); pass
    ``extra_args`` for anything else. The log goes to ``log_dir`` (default: a new
    temporary directory).
    """
    host = socket.gethostname()
    if hostname is None:
        hostname = f"w{next(_numbers)}-{secrets.token_hex(3)}@{host}"
    hostname = hostname.replace("%h", host)
    log_path = _log_dir(log_dir) / f"worker-{hostname.split('@')[0]}.log"
    cmd = [
        sys.executable, "-m", "celery", "-A", app, "worker",
        "--hostname", hostname,
        "--concurrency", str(concurrency),
        "--pool", pool,
        "--loglevel", loglevel,
        "--without-gossip", "--without-mingle",
    ]  # fmt: skip
    if not heartbeat:
        cmd.append("--without-heartbeat")
    if queues is not None:
        cmd += ["--queues", queues]
    if prefetch_multiplier is not None:
        cmd += ["--prefetch-multiplier", str(prefetch_multiplier)]
    cmd += extra_args
    proc = processes.spawn(cmd, log_path=log_path, env=_process_env(env), cwd=cwd or REPO_ROOT)
    return WorkerProcess(hostname, proc, log_path)


class BeatProcess(_CeleryProcess):
    """``python -m celery -A <app> beat`` as a real subprocess."""

    kind = "beat"

    def wait_started(self, timeout: float = 30) -> None:
        """Wait until the process runs and its log shows ``beat: Starting...``."""
        self._wait_for_log(r"beat: Starting\.\.\.", timeout, "started")


def start_beat(
    app: str,
    *,
    env: dict[str, str],
    scheduler: str | None = None,
    extra_args: Sequence[str] = (),
    log_dir: Path | None = None,
    cwd: Path | None = None,
) -> BeatProcess:
    """Start ``celery -A app beat [-S scheduler] --loglevel INFO`` without waiting.

    The default ``PersistentScheduler``'s file goes to the log directory, never to the
    repository.
    """
    name = f"beat{next(_numbers)}-{secrets.token_hex(3)}"
    directory = _log_dir(log_dir)
    log_path = directory / f"{name}.log"
    cmd = [
        sys.executable, "-m", "celery", "-A", app, "beat",
        "--loglevel", "INFO",
        "--schedule", str(directory / f"{name}-schedule"),
    ]  # fmt: skip
    if scheduler is not None:
        cmd += ["--scheduler", scheduler]
    cmd += extra_args
    proc = processes.spawn(cmd, log_path=log_path, env=_process_env(env), cwd=cwd or REPO_ROOT)
    return BeatProcess(name, proc, log_path)
