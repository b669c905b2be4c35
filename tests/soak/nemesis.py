"""The nemesis soak: real workers and beats, faults on a seeded random schedule, a checker.

Three servers on free ports: the **store** under test and the **broker** (both with an
fsynced append-only file, so a SIGKILL loses nothing acknowledged), which the nemesis
pauses and restarts; and the **observer** server (results and the observer's records),
which it never touches. Two "machines" each run a ``celery worker`` and a ``celery beat``
of :mod:`tests.apps.soak`; they share nothing local (each its own ``HOME``, ``TMPDIR``,
``XDG_RUNTIME_DIR`` and working directory), only the store and broker URLs.

The deployment profile (issue 24, section 4): prefetch as Celery ships it, pools busy
with other work, and a store that nothing ever declares new (the soak never calls
``StoreServer.flushall()``, which writes the known-new mark: the store starts empty and
unmarked, as a user's fresh ``redis-server`` does, and the gate treats it so).

A publisher thread sends every kind of task at a moderate rate and records what it sent
and what it was told (deduplicated into which id, or the publish failed). A second one
sends plain ``busy`` tasks in surges that take every pool process for seconds at a
time, so that guarded requests meet saturated pools, as on a real worker. Meanwhile the
nemesis draws a fault every few seconds from ``random.Random(seed)``: SIGKILL a pool
child, SIGKILL a worker (restarted after a moment), SIGSTOP the store or the broker for a
while (sometimes longer than ``lease_ttl``), SIGKILL and restart the store or the broker,
SIGKILL the beat leader (restarted), edit the runtime schedule (add, update, pause,
resume, remove an entry) and re-publish a copy of a redelivery-guarded message (its
task id and publish stamp, as a broker delivers it again). Each fault is
recorded with the observer server's clock. A watcher thread samples each worker's pool
pids and records a worker that died by itself as a ``worker_crash`` fault (printed, with
its log's tail, and restarted). Then everything comes back, the backlog drains, and
:func:`tests.soak.checker.check` judges the history.

The seed fixes the fault schedule and the publish stream, not the machine's timing, so a
replay is the same storm, not the same interleaving. Long form::

    python -m tests.soak.nemesis --minutes 30 --seed 7

(``PYTHONPATH`` must point at the ``src`` under test; the command prints the seed, the
report and where the logs are, and exits 1 on a violation.)
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import redis

from celery_baton.core.policy.headers import PUBLISH_HEADER
from tests.soak.checker import (
    WORKER_CRASH,
    Fault,
    History,
    Limits,
    Published,
    Report,
    Skip,
    broker_moments,
    check,
    crash_reason,
    lost_lease_task_ids,
    merge_runs,
    received_task_ids,
)
from tests.support import processes
from tests.support.celery_processes import BeatProcess, WorkerProcess
from tests.support.observer import RUNS, STARTED
from tests.support.servers import StoreServer

APP = "tests.apps.soak"
SKIPPED = "soak:skipped"  # tests.apps.soak.SKIPPED, without importing the app here
#: What the publisher sends (each a task of tests.apps.soak); ``--only`` picks some.
PUBLISH_KINDS = ("ex_skip", "ex_wait", "capped", "uq", "guarded", "rated", "busy")
#: Seconds between two looks at the workers (alive? which pool pids?).
WATCH_INTERVAL = 0.2


@dataclass
class SoakConfig:
    """One soak run. Durations in seconds."""

    seed: int
    fault_seconds: float = 120.0
    #: How long the backlog may take to drain once the faults stop.
    drain_seconds: float = 60.0
    machines: int = 2
    concurrency: int = 3
    #: Seconds between two faults (uniform).
    gap: tuple[float, float] = (2.0, 5.0)
    #: Seconds between two publishes (uniform).
    publish_gap: tuple[float, float] = (0.2, 0.45)
    #: Plain ``busy`` tasks: how long each sleeps (uniform, seconds), and their surges:
    #: for ``busy_surge`` seconds one every ``busy_surge_gap`` (with the other kinds, more
    #: work than both pools can take: every process busy, guarded requests wait), then
    #: for ``busy_calm`` seconds one every ``busy_calm_gap`` (the backlog drains). Surges
    #: rather than a steady stream at the pools' capacity, whose backlog would only grow
    #: while faults take workers away.
    busy_sleep: tuple[float, float] = (0.2, 2.0)
    busy_surge: tuple[float, float] = (3.0, 8.0)
    busy_surge_gap: tuple[float, float] = (0.1, 0.35)
    busy_calm: tuple[float, float] = (5.0, 12.0)
    busy_calm_gap: tuple[float, float] = (1.5, 3.0)
    lease_ttl: float = 6.0
    log_dir: Path | None = None
    #: Also export the store's URL as ``$BATON_URL``: a part that ignores
    #: ``Baton(app, url=...)`` then still finds the store (to look past issue 11, item 1).
    url_in_env: bool = False
    #: Publish only these kinds of task (default: every kind): a focused soak.
    only: tuple[str, ...] = ()
    #: Fault kind -> weight. Every kind listed in :meth:`Nemesis.faults`.
    weights: dict[str, float] = field(
        default_factory=lambda: {
            "kill_child": 3,
            "kill_worker": 1.5,
            "pause_store": 2,
            "restart_store": 1,
            "pause_broker": 1.5,
            "restart_broker": 1,
            "kill_beat": 1.5,
            "edit": 1.5,
            "republish": 2,
        }
    )


class Machine:
    """One "machine": a worker and a beat that share nothing local with another machine."""

    def __init__(self, index: int, root: Path, env: dict[str, str], concurrency: int) -> None:
        self.index = index
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
        cmd = [
            sys.executable, "-m", "celery", "-A", APP, "worker",
            "--hostname", hostname,
            "--concurrency", str(self.concurrency),
            "--pool", "prefork",
            "--loglevel", "INFO",
            "--without-heartbeat", "--without-gossip", "--without-mingle",
        ]  # fmt: skip
        proc, log = self._spawn("worker", cmd)
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


class Nemesis:
    """Runs one soak: ``Nemesis(SoakConfig(seed=7)).run()`` returns the checker's Report."""

    def __init__(self, config: SoakConfig) -> None:
        self.config = config
        self.rng = random.Random(config.seed)
        self.publish_rng = random.Random(config.seed * 7919 + 1)
        self.busy_rng = random.Random(config.seed * 7919 + 2)
        self.root = config.log_dir or Path(tempfile.mkdtemp(prefix=f"baton-soak-{config.seed}-"))
        self.root.mkdir(parents=True, exist_ok=True)
        self.store = StoreServer(name="soak-store")
        self.broker = StoreServer(name="soak-broker")
        self.observed = StoreServer(name="soak-observer")
        self.machines: list[Machine] = []
        self.faults: list[Fault] = []
        self.published: list[Published] = []
        # Guarded messages sent: task id, sleep, publish stamp (a copy carries the same).
        self.guarded_ids: list[tuple[str, float, str]] = []
        self._stop_publishing = threading.Event()
        self._stop_watching = threading.Event()
        self._lock = threading.Lock()
        #: Held while a worker or beat is killed, found dead or started: the fault loop
        #: and the watcher thread both do that.
        self._procs = threading.RLock()
        #: Main pids of the workers and beats the nemesis killed itself (not crashes).
        self._killed: set[int] = set()
        self._api_entry: str | None = None  # the schedule API entry's state: None, "on", "paused"
        self.app: Any = None

    # -- setup and teardown -----------------------------------------------------------

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("BATON_", "TEST_"))}
        env.update(
            SOAK_STORE_URL=self.store.url(0),
            TEST_BROKER_URL=self.broker.url(0),
            TEST_RESULT_URL=self.observed.url(1),
            TEST_OBSERVER_URL=self.observed.url(2),
            SOAK_LEASE_TTL=str(self.config.lease_ttl),
        )
        if self.config.url_in_env:
            env["BATON_URL"] = self.store.url(0)
        repo = str(processes.REPO_ROOT)
        path = env.get("PYTHONPATH")
        env["PYTHONPATH"] = f"{path}{os.pathsep}{repo}" if path else repo
        return env

    def _import_app(self, env: dict[str, str]) -> Any:
        """The soak app in this process (the publisher), bound to this run's servers."""
        for name in ("SOAK_STORE_URL", "TEST_BROKER_URL", "TEST_RESULT_URL", "TEST_OBSERVER_URL"):
            already = sys.modules.get(APP) is not None and os.environ.get(name) != env[name]
            if already:
                raise RuntimeError(f"{APP} was imported for other servers; one soak per process")
            os.environ[name] = env[name]
        os.environ["SOAK_LEASE_TTL"] = env["SOAK_LEASE_TTL"]
        return importlib.import_module(APP)

    def _setup(self) -> None:
        for server in (self.store, self.broker, self.observed):
            server.start()
        env = self._env()
        self.module = self._import_app(env)
        self.app = self.module.app
        self.clock = Clock(self.observed.client(2))
        self.observer_db = self.observed.client(2)
        self.results_db = self.observed.client(1)
        for i in range(1, self.config.machines + 1):
            machine = Machine(i, self.root, env, self.config.concurrency)
            machine.start_worker()
            machine.start_beat()
            self.machines.append(machine)
        for machine in self.machines:
            assert machine.worker is not None and machine.beat is not None
            machine.worker.wait_ready(timeout=90)
            machine.beat.wait_started(timeout=60)

    def _teardown(self) -> None:
        for machine in self.machines:
            for proc in machine.every:
                processes.signal_quietly(proc._proc, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for machine in self.machines:
            for proc in machine.every:
                proc._end(max(0.0, deadline - time.monotonic()), sigterm=False)

    def close(self) -> None:
        """Stop every process and server; the log directory stays for a post-mortem."""
        with contextlib.suppress(Exception):
            self._teardown()
        for server in (self.store, self.broker, self.observed):
            with contextlib.suppress(Exception):
                server.resume()
                server.stop()
        for server in (self.store, self.broker, self.observed):
            shutil.rmtree(server.data_dir, ignore_errors=True)
        self._end_embedded_stores()

    def _end_embedded_stores(self) -> None:
        """SIGTERM embedded stores that a process of this run started on a machine (a part
        that did not resolve the store it was given starts one; the checker sees it)."""
        for machine in self.machines:
            for pid_file in (machine.root / "run").glob("*/*.pid"):
                with contextlib.suppress(ValueError, OSError):
                    pid = int(pid_file.read_text().strip())
                    os.kill(pid, signal.SIGTERM)
                    print(f"nemesis: stopped the embedded store {pid} of {machine.root}")

    # -- the run ------------------------------------------------------------------------

    def run(self) -> Report:
        """Set up, publish under faults, heal, drain, stop, check. Never raises on a
        violation: the Report says what was found."""
        print(f"nemesis soak: seed={self.config.seed} logs={self.root}", flush=True)
        self._setup()
        watcher = threading.Thread(target=self._watch_loop, name="soak-watcher", daemon=True)
        watcher.start()
        publishers = [
            threading.Thread(target=self._publish_loop, name="soak-publisher", daemon=True)
        ]
        if not self.config.only or "busy" in self.config.only:
            publishers.append(
                threading.Thread(target=self._busy_loop, name="soak-busy", daemon=True)
            )
        for publisher in publishers:
            publisher.start()
        try:
            self._fault_loop()
        finally:
            self._stop_publishing.set()
            for publisher in publishers:
                publisher.join(timeout=30)
            self._heal()
        try:
            self._drain()
        finally:
            # Before the teardown: workers that exit on its SIGTERM did not crash.
            self._stop_watching.set()
            watcher.join(timeout=30)
        self._dump_store()
        self._teardown()
        history = self._history()
        (self.root / "history.json").write_text(_dump(history))
        report = check(history, seed=self.config.seed)
        (self.root / "report.txt").write_text(report.summary(shown=1000))
        return report

    def _fault_loop(self) -> None:
        faults = self.faults_table()
        kinds = list(self.config.weights)
        weights = [self.config.weights[k] for k in kinds]
        deadline = time.monotonic() + self.config.fault_seconds
        while True:
            gap = self.rng.uniform(*self.config.gap)
            if time.monotonic() + gap >= deadline:
                break
            time.sleep(gap)
            kind = self.rng.choices(kinds, weights)[0]
            try:
                faults[kind]()
            except Exception as exc:  # a fault that could not be injected is no verdict
                print(f"nemesis: {kind} failed: {exc!r}", flush=True)
            self._restart_dead()
        time.sleep(max(0.0, deadline - time.monotonic()))

    def faults_table(self) -> dict[str, Callable[[], None]]:
        return {
            "kill_child": self.kill_child,
            "kill_worker": self.kill_worker,
            "pause_store": lambda: self._pause(self.store, "pause_store"),
            "restart_store": lambda: self._restart(self.store, "restart_store"),
            "pause_broker": lambda: self._pause(self.broker, "pause_broker"),
            "restart_broker": lambda: self._restart(self.broker, "restart_broker"),
            "kill_beat": self.kill_beat,
            "edit": self.edit_schedule,
            "republish": self.republish,
        }

    def _record(self, kind: str, start: int, pids: tuple[int, ...] = (), detail: str = "") -> None:
        fault = Fault(kind, start, self.clock.now(), pids, detail)
        self.faults.append(fault)
        print(f"nemesis: {kind} {detail} ({fault.length / 1e6:.2f} s)", flush=True)

    # -- the faults ----------------------------------------------------------------------

    def kill_child(self) -> None:
        live = [m.worker for m in self.machines if m.worker and m.worker.is_running]
        if not live:
            return
        worker = self.rng.choice(live)
        children = worker.pool_pids()
        if not children:
            return
        pid = self.rng.choice(sorted(children))
        start = self.clock.now()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        self._record("kill_child", start, (pid,), f"{worker.hostname} child {pid}")

    def kill_worker(self) -> None:
        machine = self.rng.choice(self.machines)
        down = self.rng.uniform(1.0, 3.0)
        with self._procs:
            worker = machine.worker
            if worker is None or not worker.is_running:
                return
            pids = (worker.pid, *worker.pool_pids())
            start = self.clock.now()
            self._killed.add(worker.pid)
            worker.kill()
        self._record("kill_worker", start, pids, f"{worker.hostname}, restarted after {down:.1f} s")
        time.sleep(down)
        with self._procs:
            machine.start_worker()

    def kill_beat(self) -> None:
        down = self.rng.uniform(1.0, 3.0)
        beats = [m for m in self.machines if m.beat and m.beat.is_running]
        if not beats:
            return
        leader = self._leader_pid()
        chosen = next((m for m in beats if m.beat and m.beat.pid == leader), None)
        machine = chosen or self.rng.choice(beats)
        assert machine.beat is not None
        with self._procs:
            pid = machine.beat.pid
            start = self.clock.now()
            self._killed.add(pid)
            machine.beat.kill()
        what = "leader" if chosen else "a beat (no leader found)"
        self._record("kill_beat", start, (pid,), f"{what} pid {pid}, restarted after {down:.1f} s")
        time.sleep(down)
        with self._procs:
            machine.start_beat()

    def _leader_pid(self) -> int | None:
        """The pid in the beat leader lease's owner (``host:pid:nonce``), if the store
        answers; the lease key is found by its shape, not by its name."""
        try:
            with self.store.client() as r:
                for key in r.scan_iter(match="*leader*", count=1000):
                    if r.type(key) == "hash":
                        owner = r.hget(key, "owner")
                        if owner and owner.count(":") >= 2:
                            return int(owner.split(":")[-2])
        except (redis.RedisError, ValueError):
            return None
        return None

    def _pause(self, server: StoreServer, kind: str) -> None:
        # Now and then longer than lease_ttl: leases run out while their runs go on,
        # the documented "lease lost" window (docs/failure.md).
        if self.rng.random() < 0.15:
            length = self.config.lease_ttl + self.rng.uniform(1.0, 2.0)
        else:
            length = self.rng.uniform(0.5, 3.0)
        start = self.clock.now()
        server.pause()
        try:
            time.sleep(length)
        finally:
            server.resume()
        self._record(kind, start, detail=f"SIGSTOP {length:.1f} s")

    def _restart(self, server: StoreServer, kind: str) -> None:
        down = self.rng.uniform(0.5, 2.0)
        start = self.clock.now()
        server.restart(kill=True, down_for=down)
        self._record(kind, start, detail=f"SIGKILL, down {down:.1f} s, same data (AOF)")

    def edit_schedule(self) -> None:
        from celery_baton.beat.api import ScheduleStore
        from celery_baton.store.connection import connect

        name = "api2"
        if self._api_entry is None:
            op = "add"
        else:
            ops = ["update", "remove", "resume" if self._api_entry == "paused" else "pause"]
            op = self.rng.choice(ops)
        every = self.rng.choice([1.0, 2.0, 3.0])
        start = self.clock.now()
        # The store's URL is given explicitly: this process must not start a store of its
        # own whatever the app's settings resolve to.
        with ScheduleStore(self.app, store=connect(self.store.url(0), socket_timeout=2)) as api:
            if op == "add":
                api.add(name, f"{APP}.tick", every, args=[name])
                self._api_entry = "on"
            elif op == "update":
                api.update(name, schedule=every)
            elif op == "remove":
                api.remove(name)
                self._api_entry = None
            elif op == "pause":
                api.pause(name)
                self._api_entry = "paused"
            else:
                api.resume(name)
                self._api_entry = "on"
        detail = f"{op} {name}" + (f" every {every:g} s" if op in ("add", "update") else "")
        self._record("edit", start, detail=detail)

    def republish(self) -> None:
        with self._lock:
            if not self.guarded_ids:
                return
            task_id, sleep, stamp = self.rng.choice(self.guarded_ids)
        start = self.clock.now()
        copy = {PUBLISH_HEADER: stamp}  # the same message again, as a redelivery
        self._send("guarded", (sleep,), task_id=task_id, detail="republished", headers=copy)
        self._record("republish", start, detail=f"guarded {task_id}")

    # -- publishing ----------------------------------------------------------------------

    def _publish_loop(self) -> None:
        rng = self.publish_rng
        weighted = {"ex_skip": 2, "ex_wait": 2, "capped": 2, "uq": 2, "guarded": 1.5, "rated": 1.5}
        kinds = [k for k in weighted if not self.config.only or k in self.config.only]
        if not kinds:
            return  # --only busy
        weights = [weighted[k] for k in kinds]
        n = 0
        while not self._stop_publishing.wait(rng.uniform(*self.config.publish_gap)):
            kind = rng.choices(kinds, weights)[0]
            n += 1
            if kind == "ex_skip":
                self._send(kind, (rng.choice("ab"), round(rng.uniform(0.2, 1.5), 2)))
            elif kind == "ex_wait":
                self._send(kind, (rng.choice("ab"), round(rng.uniform(0.2, 1.0), 2)))
            elif kind == "capped":
                self._send(kind, (n, round(rng.uniform(0.5, 2.0), 2)))
            elif kind == "uq":
                # Half of them with expires= shorter than some runs (issue 11, item 4).
                expiring = rng.random() < 0.5
                args = (rng.choice("abc"), round(rng.uniform(0.5, 3.0), 2))
                if expiring:
                    self._send(kind, args, detail="expires=2", expires=2)
                else:
                    self._send(kind, args)
            elif kind == "guarded":
                sleep = round(rng.uniform(0.2, 1.0), 2)
                stamp = secrets.token_hex(8)  # not from rng: the seeded stream is kept
                task_id = self._send(kind, (sleep,), headers={PUBLISH_HEADER: stamp})
                if task_id:
                    with self._lock:
                        self.guarded_ids.append((task_id, sleep, stamp))
            else:
                # Groups of up to 8 (admitted over up to 1.5 s at 4/s, burst 2): a group
                # that meets a saturated pool shows whether the limit holds at the start.
                for _ in range(rng.randint(1, 8)):
                    n += 1
                    self._send(kind, (n,))

    def _busy_loop(self) -> None:
        """Plain ``busy`` tasks in surges and calms (``SoakConfig.busy_*``)."""
        rng, config = self.busy_rng, self.config
        surge = True
        while not self._stop_publishing.is_set():
            length = config.busy_surge if surge else config.busy_calm
            until = time.monotonic() + rng.uniform(*length)
            gap = config.busy_surge_gap if surge else config.busy_calm_gap
            while time.monotonic() < until:
                if self._stop_publishing.wait(rng.uniform(*gap)):
                    return
                self._send("busy", (round(rng.uniform(*config.busy_sleep), 2),))
            surge = not surge

    def _send(
        self,
        kind: str,
        args: tuple[Any, ...],
        *,
        task_id: str | None = None,
        detail: str = "",
        **options: Any,
    ) -> str | None:
        """Publish one task and record what the publisher was told; its id if it was sent."""
        task = getattr(self.module, kind)
        task_id = task_id or str(uuid.uuid4())
        at = self.clock.now()
        try:
            result = task.apply_async(args, task_id=task_id, **options)
        except Exception as exc:
            self.published.append(
                Published(task_id, kind, at, "failed", detail=f"{detail} {exc!r}"[:300])
            )
            return None
        if result.id != task_id:
            self.published.append(
                Published(task_id, kind, at, "deduplicated", into=result.id, detail=detail)
            )
            return None
        self.published.append(Published(task_id, kind, at, "sent", detail=detail))
        return task_id

    # -- healing and draining ------------------------------------------------------------

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

    def _heal(self) -> None:
        for server in (self.store, self.broker):
            server.resume()
            server.start()
        self._restart_dead()

    def _drain(self) -> None:
        """Wait until every sent or deduplicated id has a result and nothing runs."""
        deadline = time.monotonic() + self.config.drain_seconds
        quiet_since: float | None = None
        while time.monotonic() < deadline:
            ids = sorted({p.task_id for p in self.published if p.outcome != "failed"})
            pipe = self.results_db.pipeline(transaction=False)
            for task_id in ids:
                pipe.exists(f"celery-task-meta-{task_id}")
            missing = sum(1 for found in pipe.execute() if not found)
            running = self._runs_in_progress()
            if missing == 0 and running <= 0:
                quiet_since = quiet_since or time.monotonic()
                if time.monotonic() - quiet_since > 3:
                    return
            else:
                quiet_since = None
            time.sleep(0.5)
        print(f"nemesis: drain incomplete after {self.config.drain_seconds} s", flush=True)

    def _runs_in_progress(self) -> int:
        """Runs started in the last 10 s that have not finished (a killed run never
        finishes: older ones are not waited for)."""
        started = [json.loads(x) for x in self.observer_db.lrange(STARTED, -300, -1)]
        finished = {
            (e["task_id"], e["start"])
            for e in map(json.loads, self.observer_db.lrange(RUNS, -600, -1))
        }
        now = self.clock.now()
        return sum(
            1
            for e in started
            if now - int(e["start"]) < 10_000_000 and (e["task_id"], e["start"]) not in finished
        )

    def _dump_store(self) -> None:
        """The store's keys after the drain, in ``store.txt``: who still holds what (a
        lease's owner names its task id and worker) for a post-mortem."""
        lines = []
        try:
            with self.store.client() as r:
                for key in sorted(r.scan_iter(count=1000))[:5000]:
                    kind = r.type(key)
                    if kind == "hash":
                        value: Any = r.hgetall(key)
                    elif kind == "string":
                        value = r.get(key)
                    elif kind == "zset":
                        value = r.zrange(key, 0, 50, withscores=True)
                    elif kind == "list":
                        value = r.lrange(key, 0, 50)
                    elif kind == "set":
                        value = sorted(r.sscan_iter(key, count=100))[:50]
                    else:
                        value = "?"
                    lines.append(f"{key} {kind} ttl={r.pttl(key)} {value}")
        except redis.RedisError as exc:
            lines.append(f"store unreadable: {exc!r}")
        (self.root / "store.txt").write_text("\n".join(lines) + "\n")

    # -- the history -------------------------------------------------------------------

    def _history(self) -> History:
        started = [json.loads(x) for x in self.observer_db.lrange(STARTED, 0, -1)]
        finished = [json.loads(x) for x in self.observer_db.lrange(RUNS, 0, -1)]
        skips = [
            Skip(
                task_id=e["task_id"],
                reason=e["reason"],
                at=int(e["at"]),
                holder=e.get("holder", ""),
                key=e.get("key", ""),
                task=e.get("task", ""),
            )
            for e in map(json.loads, self.observer_db.lrange(SKIPPED, 0, -1))
        ]
        ids = sorted({p.task_id for p in self.published} | {s.task_id for s in skips})
        results: dict[str, str] = {}
        pipe = self.results_db.pipeline(transaction=False)
        for task_id in ids:
            pipe.get(f"celery-task-meta-{task_id}")
        for task_id, raw in zip(ids, pipe.execute(), strict=True):
            if raw:
                results[task_id] = _state(json.loads(raw))
        lost: set[str] = set()
        received: set[str] = set()
        moments: dict[str, tuple[int, bool]] = {}
        for machine in self.machines:
            logs = machine.logs()
            lost |= lost_lease_task_ids(logs)
            received |= received_task_ids(logs)
            for task_id, moment in broker_moments(logs).items():
                moments[task_id] = max(moments.get(task_id, moment), moment)
        return History(
            runs=merge_runs(started, finished),
            published=list(self.published),
            skips=skips,
            faults=list(self.faults),
            results=results,
            lost_leases=lost,
            received=received,
            to_broker={task_id: at for task_id, (at, handed) in moments.items() if handed},
            limits=Limits(
                lease_ttl=self.config.lease_ttl,
                cap=self.module.CAP,
                rate=self.module.RATE,
                burst=self.module.BURST,
                # visibility_timeout, then a restore each second under a 5 s mutex.
                redelivery=self.module.VISIBILITY + 10.0,
                pool_size=self.config.machines * self.config.concurrency,
            ),
        )


def _in_group(pids: set[int], group: int) -> list[psutil.Process]:
    """The processes among ``pids`` still alive in process group ``group``."""
    found = []
    for pid in sorted(pids):
        with contextlib.suppress(psutil.Error, OSError):
            if os.getpgid(pid) == group:
                found.append(psutil.Process(pid))
    return found


def _state(meta: dict[str, Any]) -> str:
    status = str(meta.get("status", ""))
    result = meta.get("result")
    if status == "FAILURE" and isinstance(result, dict) and result.get("exc_type"):
        return f"{status}:{result['exc_type']}"
    return status


def _dump(history: History) -> str:
    from dataclasses import asdict

    data = asdict(history)
    data["lost_leases"] = sorted(history.lost_leases)
    data["received"] = sorted(history.received or ())
    return json.dumps(data, indent=1, default=str)


def soak(config: SoakConfig) -> Report:
    """Run one soak and clean up its processes and servers."""
    nemesis = Nemesis(config)
    try:
        return nemesis.run()
    finally:
        nemesis.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.soak.nemesis", description=__doc__)
    parser.add_argument("--seed", type=int, default=None, help="default: random, printed")
    parser.add_argument("--minutes", type=float, default=30.0, help="minutes of faults")
    parser.add_argument("--runs", type=int, default=1, help="runs, seeds seed, seed+1, ...")
    parser.add_argument("--drain", type=float, default=90.0, help="seconds to drain")
    parser.add_argument("--logs", type=Path, default=None, help="log directory (default: temp)")
    parser.add_argument(
        "--url-in-env",
        action="store_true",
        help="also export the store URL as $BATON_URL (parts that ignore Baton(url=) find it)",
    )
    parser.add_argument(
        "--only",
        default="",
        help=f"publish only these kinds, comma-separated ({','.join(PUBLISH_KINDS)})",
    )
    parser.add_argument(
        "--faults",
        default="",
        help="inject only these fault kinds, comma-separated (default: all, see docs/soak.md)",
    )
    args = parser.parse_args(argv)
    only = tuple(k for k in args.only.split(",") if k)
    unknown = sorted(set(only) - set(PUBLISH_KINDS))
    if unknown:
        parser.error(f"--only: unknown kind(s) {unknown}; choose from {list(PUBLISH_KINDS)}")
    weights = SoakConfig(seed=0).weights
    faults = tuple(k for k in args.faults.split(",") if k)
    unknown = sorted(set(faults) - set(weights))
    if unknown:
        parser.error(f"--faults: unknown kind(s) {unknown}; choose from {sorted(weights)}")
    if faults:
        weights = {k: w for k, w in weights.items() if k in faults}
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 30)
    if args.runs > 1:
        # The soak app binds this process to one run's servers: one process per run.
        given = list(sys.argv[1:] if argv is None else argv)
        failed = 0
        for run in range(args.runs):
            again = [*given, "--runs", "1", "--seed", str(seed + run)]
            cmd = [sys.executable, "-m", "tests.soak.nemesis", *again]
            failed += subprocess.run(cmd, check=False).returncode != 0
        print(f"nemesis soak: {args.runs - failed} of {args.runs} runs OK", flush=True)
        return 1 if failed else 0
    failed = 0
    for run in range(args.runs):
        config = SoakConfig(
            seed=seed + run,
            fault_seconds=args.minutes * 60,
            drain_seconds=args.drain,
            log_dir=args.logs / f"seed-{seed + run}" if args.logs else None,
            url_in_env=args.url_in_env,
            only=only,
            weights=weights,
        )
        report = soak(config)
        print(report.summary(), flush=True)
        failed += not report.ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
