"""The demo's processes: a private embedded store, its workers and beats, each with a
log of its own; stopped together, and a death reported with its own error line."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import redis

from celery_baton.store.connection import ensure_embedded_server

# The line that names an exception in a traceback: "ModuleNotFoundError: No module ..."
ERROR_LINE = re.compile(r"^\s*([A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt))\b.*")


def say(text: str) -> None:
    print(text, flush=True)


class Processes:
    """The demo's store, workers and beats (``celery_baton.demo.app``)."""

    def __init__(self) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="baton-demo-"))
        self.sock: Path | None = None  # the demo's own embedded server, once started
        self.procs: list[subprocess.Popen[bytes]] = []
        self.beats: list[subprocess.Popen[bytes]] = []
        self.names: dict[int, str] = {}  # pid -> "worker1", the name of its log

    def start_store(self) -> None:
        # A private embedded server, so the demo never touches a shared one.
        os.environ["BATON_RUNTIME_DIR"] = str(self.tmp)
        sock = ensure_embedded_server()
        self.sock = sock
        self.env = dict(
            os.environ,
            BATON_URL=f"unix://{sock}?db=15",
            BATON_DEMO_BROKER=f"redis+socket://{sock}?virtual_host=14",
            BATON_DEMO_OBSERVER=f"unix://{sock}?db=13",
            PYTHONUNBUFFERED="1",
        )
        os.environ.update(self.env)  # this process publishes through the same app
        self.observer = redis.Redis(unix_socket_path=str(sock), db=13)
        self.store = redis.Redis(unix_socket_path=str(sock), db=15, decode_responses=True)
        say(f"  store and broker: embedded Valkey on {sock}")

    def spawn(self, kind: str, n: int) -> subprocess.Popen[bytes]:
        base = [sys.executable, "-m", "celery", "-A", "celery_baton.demo.app"]
        log = open(self.tmp / f"{kind}{n}.log", "wb")  # noqa: SIM115 - closed with the process
        if kind == "worker":
            args = [
                *base,
                "worker",
                "-c",
                "2",
                "-n",
                f"demo{n}@%h",
                "-l",
                "INFO",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
            ]
        else:
            args = [
                *base,
                "beat",
                "-l",
                "INFO",
                "-s",
                str(self.tmp / f"beat{n}.db"),
                "--pidfile",
                "",
            ]
        proc = subprocess.Popen(
            args, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.procs.append(proc)
        self.names[proc.pid] = f"{kind}{n}"
        return proc

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def wait_for(self, what: str, check: Callable[[], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if check():
                return True
            for proc in self.procs:
                if proc in self.beats:
                    continue
                if proc.poll() is not None:
                    raise RuntimeError(self.death_report(proc, what))
            time.sleep(0.1)
        return False

    def death_report(self, proc: subprocess.Popen[bytes], what: str) -> str:
        """Why a process died, from its own log: the error itself, not just "see logs"."""
        name = self.names.get(proc.pid, "a demo process")
        log = self.tmp / f"{name}.log"
        lines = log.read_text(errors="replace").splitlines() if log.exists() else []
        errors = [line for line in lines if ERROR_LINE.match(line)]
        cause = errors[-1] if errors else "\n".join(lines[-10:]) or "(its log is empty)"
        return (
            f"{name} died (exit status {proc.returncode}) while waiting for {what}:\n"
            f"    {cause}\n  its whole log: {log}"
        )
