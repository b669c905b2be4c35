"""The soak's "machines", its one clock, and the watch over the workers and beats.

Two "machines" each run a ``celery worker`` and a ``celery beat`` of :mod:`tests.apps.soak`;
they share nothing local (each its own ``HOME``, ``TMPDIR``, ``XDG_RUNTIME_DIR`` and working
directory), only the store and broker URLs.

A watcher thread samples each worker's pool pids and records a worker that died by itself
as a ``worker_crash`` fault (printed, with its log's tail, and restarted).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import redis

from tests.soak.checker import WORKER_CRASH, Fault, crash_reason
from tests.support import processes
from tests.support.celery_processes import BeatProcess, WorkerProcess

APP = "tests.apps.soak"
#: Seconds between two looks at the workers (alive? which pool pids?).
WATCH_INTERVAL = 0.2


#: The ways Celery runs a task that the soak's workers take (issue 34): each assumption a
#: mechanism makes of the pool (a free semaphore is a ready process, a pid names a
#: process, one thread writes the channel, the time limits start at the accept) is met
#: under faults. ``--time-limit`` is far above any soak task: the limits run, never fire.
WORKER_PROFILES = (
    "prefork", "recycling", "autoscale", "time-limits", "threads", "gevent", "eventlet",
)  # fmt: skip
#: The short soak's (CI's): the prefork pool as deployments run it; the other pools run
#: in the long form (``--profiles all``). (The threads pool was left out when it had no
#: check of a late grant at the body's start: seed 305374608 saw five starts in 0.5 s of
#: a 4/s limit; threads, gevent and eventlet are judged there now, issue 34.)
PREFORK_PROFILES = ("prefork", "recycling", "autoscale", "time-limits")


def worker_profile_args(profile: str, concurrency: int) -> list[str]:
    """The ``celery worker`` arguments of one profile of WORKER_PROFILES."""
    if profile == "recycling":
        return [
            "--pool",
            "prefork",
            "--concurrency",
            str(concurrency),
            "--max-tasks-per-child",
            "3",
        ]
    if profile == "autoscale":
        return ["--pool", "prefork", "--autoscale", f"{concurrency},1"]
    if profile == "time-limits":
        return [
            "--pool", "prefork", "--concurrency", str(concurrency),
            "--time-limit", "120", "--soft-time-limit", "100",
        ]  # fmt: skip
    if profile in ("threads", "gevent", "eventlet", "prefork"):
        return ["--pool", profile, "--concurrency", str(concurrency)]
    raise ValueError(f"unknown worker profile {profile!r}; one of {WORKER_PROFILES}")


class Machine:
    """One "machine": a worker and a beat that share nothing local with another machine."""

    def __init__(
        self,
        index: int,
        root: Path,
        env: dict[str, str],
        concurrency: int,
        profiles: tuple[str, ...] = ("prefork",),
    ) -> None:
        self.index = index
        #: The ways Celery runs a task that this machine's workers take in turn (one per
        #: start: a restarted worker comes back under the next), see WORKER_PROFILES.
        self.profiles = profiles
        self.root = root / f"machine{index}"
        for sub in ("home", "tmp", "run", "cwd", "logs"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        (self.root / "run").chmod(0o700)
        self.env = {
            **env,
            "HOME": str(self.root / "home"),
            "TMPDIR": str(self.root / "tmp"),
            "XDG_RUNTIME_DIR": str(self.root / "run"),
            "PYTHONUNBUFFERED": "1",
        }
        self.concurrency = concurrency
        self.worker: WorkerProcess | None = None
        self.beat: BeatProcess | None = None
        self.every: list[WorkerProcess | BeatProcess] = []
        #: Pool pids the watcher has seen under the current worker (sampled while it
        #: lives: once its main process is gone its children cannot be found from it).
        self.pool_seen: set[int] = set()
        #: When the watcher last saw the current worker alive (observer clock).
        self.seen_alive = 0
        self._starts = 0

    def _spawn(self, kind: str, cmd: list[str]) -> tuple[Any, Path]:
        self._starts += 1
        log = self.root / "logs" / f"{kind}{self._starts}.log"
        proc = processes.spawn(cmd, log_path=log, env=self.env, cwd=self.root / "cwd")
        return proc, log

    def start_worker(self) -> WorkerProcess:
        hostname = f"soak{self.index}@{socket.gethostname()}"
        profile = self.profiles[(self.index + self._starts) % len(self.profiles)]
        cmd = [
            sys.executable, "-m", "celery", "-A", APP, "worker",
            "--hostname", hostname,
            *worker_profile_args(profile, self.concurrency),
            "--loglevel", "INFO",
            "--without-heartbeat", "--without-gossip", "--without-mingle",
        ]  # fmt: skip
        proc, log = self._spawn(f"worker-{profile}-", cmd)
        self.worker = WorkerProcess(hostname, proc, log)
        self.pool_seen = set()
        self.every.append(self.worker)
        return self.worker

    def start_beat(self) -> BeatProcess:
        cmd = [
            sys.executable, "-m", "celery", "-A", APP, "beat",
            "--loglevel", "INFO",
            "--schedule", str(self.root / "cwd" / "beat-schedule"),
        ]  # fmt: skip
        proc, log = self._spawn("beat", cmd)
        self.beat = BeatProcess(f"beat{self.index}", proc, log)
        self.every.append(self.beat)
        return self.beat

    def logs(self) -> str:
        return "\n".join(p.log_text() for p in self.every if p.log_path.exists())


class Clock:
    """The observer server's ``TIME`` in microseconds: the one clock of the history."""

    def __init__(self, client: redis.Redis) -> None:
        self._client = client

    def now(self) -> int:
        seconds, micros = self._client.time()
        return int(seconds) * 1_000_000 + int(micros)


class Watcher:
    """The watch over the machines, a part of :class:`tests.soak.nemesis.Nemesis`: workers
    and beats found dead are started again, and a worker that died by itself is recorded
    as a ``worker_crash`` fault."""

    # The Nemesis's state that the watch reads and writes.
    machines: list[Machine]
    faults: list[Fault]
    clock: Clock
    _stop_watching: threading.Event
    _procs: threading.RLock
    _killed: set[int]

    def _restart_dead(self) -> None:
        with self._procs:
            self._watch_workers()
            for machine in self.machines:
                if machine.worker is None or not machine.worker.is_running:
                    machine.start_worker()
                beat = machine.beat
                if beat is None or not beat.is_running:
                    if beat is not None and beat.pid not in self._killed:
                        print(
                            f"nemesis: beat pid {beat.pid} exited by itself ({beat.returncode}); "
                            f"last lines of {beat.log_path}:\n{beat.log_tail(15)}",
                            flush=True,
                        )
                    machine.start_beat()

    # -- workers that die by themselves ------------------------------------------------

    def _watch_loop(self) -> None:
        while not self._stop_watching.wait(WATCH_INTERVAL):
            try:
                self._watch_workers()
            except Exception as exc:  # the observer server is never touched: unexpected
                print(f"nemesis: watching the workers failed: {exc!r}", flush=True)

    def _watch_workers(self) -> None:
        """Sample each worker's pool pids; record a worker that died without the nemesis
        killing it as a ``worker_crash`` fault, and start it again as kill_worker does."""
        with self._procs:
            now = self.clock.now()
            for machine in self.machines:
                worker = machine.worker
                if worker is None or worker.pid in self._killed:
                    continue
                if worker.is_running:
                    machine.pool_seen.update(worker.pool_pids())
                    machine.seen_alive = now
                    continue
                self._record_crash(machine, worker)
                machine.start_worker()

    def _record_crash(self, machine: Machine, worker: WorkerProcess) -> None:
        """A worker's main process exited by itself (Celery 5.7's consumer dies on some
        broker restarts: issue 11). Its runs are judged as a killed worker's: the fault
        holds its main pid and every pool pid seen under it, and ends when they are all
        gone (pool processes it left behind are SIGKILLed here, as kill_worker's are)."""
        self._killed.add(worker.pid)  # recorded once
        # Its own session and process group: the group finds orphans (a pid may be reused).
        survivors = _in_group(machine.pool_seen, worker.pid)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(worker.pid, signal.SIGKILL)
        _, alive = psutil.wait_procs(survivors, timeout=5)
        noticed = self.clock.now()
        offset = noticed - int(time.time() * 1_000_000)
        text = worker.log_text() if worker.log_path.exists() else ""
        reason, logged_at = crash_reason(text)
        # The worker stopped acknowledging when its consumer died (the log's line), or,
        # without such a line, some time after it was last seen alive.
        start = machine.seen_alive or noticed
        if logged_at is not None:
            start = min(int(logged_at * 1_000_000) + offset, noticed)
        detail = (
            f"{worker.hostname} pid {worker.pid} exited {worker.returncode} by itself "
            f"({reason or 'no error in its log'}); {len(survivors)} pool process(es) left "
            f"behind, SIGKILLed{' (some still alive!)' if alive else ''}; restarted"
        )
        pids = (worker.pid, *sorted(machine.pool_seen))
        fault = Fault(WORKER_CRASH, start, noticed, pids, detail)
        self.faults.append(fault)
        bar = "!" * 78
        print(
            f"{bar}\nnemesis: WORKER CRASH (not injected: a bug to find): "
            f"{detail}\nnemesis: last lines of {worker.log_path}:\n{worker.log_tail(25)}\n{bar}",
            flush=True,
        )


def _in_group(pids: set[int], group: int) -> list[psutil.Process]:
    """The processes among ``pids`` still alive in process group ``group``."""
    found = []
    for pid in sorted(pids):
        with contextlib.suppress(psutil.Error, OSError):
            if os.getpgid(pid) == group:
                found.append(psutil.Process(pid))
    return found
