"""The nemesis soak: real workers and beats, faults on a seeded random schedule, a checker.

Three servers on free ports: the **store** under test and the **broker** (both with an
fsynced append-only file, so a SIGKILL loses nothing acknowledged), which the nemesis
pauses and restarts; and the **observer** server (results and the observer's records),
which it never touches. Two "machines" each run a ``celery worker`` and a ``celery beat``
of :mod:`tests.apps.soak` (:mod:`tests.soak.machines`).

The deployment profile (issue 24, section 4): prefetch as Celery ships it, pools busy
with other work, and a store that nothing ever declares new (the soak never calls
``StoreServer.flushall()``, which writes the known-new mark: the store starts empty and
unmarked, as a user's fresh ``redis-server`` does, and the gate treats it so).

Publisher threads send the workload (:mod:`tests.soak.workload`) while the nemesis
injects a fault every few seconds (:mod:`tests.soak.faults`) and a watcher thread
records the workers that die by themselves (:mod:`tests.soak.machines`). Then
everything comes back, the backlog drains, the history is read back
(:mod:`tests.soak.recording`) and :func:`tests.soak.checker.check` judges it.

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
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from tests.soak.checker import Cancel, Fault, Published, Report, check
from tests.soak.config import PUBLISH_KINDS, SoakConfig
from tests.soak.faults import Faults
from tests.soak.machines import APP, WORKER_PROFILES, Clock, Machine, Watcher
from tests.soak.recording import Recorder, _dump
from tests.soak.workload import Workload
from tests.support import processes
from tests.support.observer import RUNS, STARTED
from tests.support.servers import StoreServer


class Nemesis(Faults, Workload, Watcher, Recorder):
    """Runs one soak: ``Nemesis(SoakConfig(seed=7)).run()`` returns the checker's Report.

    Its parts, each in a module of its own: the faults, the publishers, the watch over
    the machines and the reading back of the history."""

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
        # The publisher's baton.cancel calls (the ``cancelled`` kind).
        self.cancels: list[Cancel] = []
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
        # Absolute: the workers and beats run in directories of their own, where a
        # relative entry (``PYTHONPATH=src``) finds nothing, and they would import the
        # celery_baton installed in the environment instead of the code under test.
        path = os.pathsep.join(
            str(Path(entry).resolve())
            for entry in env.get("PYTHONPATH", "").split(os.pathsep)
            if entry
        )
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
            machine = Machine(i, self.root, env, self.config.concurrency, self.config.profiles)
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

    # -- healing and draining ------------------------------------------------------------

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
        "--profiles",
        default="prefork",
        help="worker profiles the workers take in turn, comma-separated, or 'all' "
        f"({','.join(WORKER_PROFILES)})",
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
    profiles = WORKER_PROFILES if args.profiles == "all" else tuple(args.profiles.split(","))
    unknown = sorted(set(profiles) - set(WORKER_PROFILES))
    if unknown:
        parser.error(f"--profiles: unknown {unknown}; choose from {list(WORKER_PROFILES)}")
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
            profiles=profiles,
        )
        report = soak(config)
        print(report.summary(), flush=True)
        failed += not report.ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
