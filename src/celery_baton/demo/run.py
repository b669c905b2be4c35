"""The demo's driver: real processes, one scenario per guarantee, a table at the end."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import redis

from celery_baton import __version__
from celery_baton.core.policy.headers import PUBLISH_HEADER
from celery_baton.store.connection import ensure_embedded_server, stop_embedded_server

WORKERS = 2
BEATS = 2
# The line that names an exception in a traceback: "ModuleNotFoundError: No module ..."
ERROR_LINE = re.compile(r"^\s*([A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt))\b.*")


@dataclass
class Result:
    guarantee: str
    measured: str
    ok: bool


def say(text: str) -> None:
    print(text, flush=True)


class Demo:
    def __init__(self) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="baton-demo-"))
        self.procs: list[subprocess.Popen[bytes]] = []
        self.beats: list[subprocess.Popen[bytes]] = []
        self.results: list[Result] = []
        self.names: dict[int, str] = {}  # pid -> "worker1", the name of its log

    # -- processes ------------------------------------------------------------------

    def start_store(self) -> None:
        # A private embedded server, so the demo never touches a shared one.
        os.environ["BATON_RUNTIME_DIR"] = str(self.tmp)
        sock = ensure_embedded_server()
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

    def runs(self, kind: str) -> list[dict[str, Any]]:
        return [
            r
            for r in (
                json.loads(x) for x in cast(list[bytes], self.observer.lrange("demo:runs", 0, -1))
            )
            if r["kind"] == kind
        ]

    def record(self, guarantee: str, measured: str, ok: bool) -> None:
        self.results.append(Result(guarantee, measured, ok))
        say(f"  {'ok  ' if ok else 'FAIL'} {guarantee}: {measured}")

    # -- scenarios ------------------------------------------------------------------

    def exclusive(self) -> None:
        from celery_baton.demo.app import import_feed

        say("\n[1/6] exclusive: 5 imports of each of 4 feeds sent at once, 2 workers")
        feeds = [f"https://example.org/feed/{i}" for i in range(4)]
        for _ in range(5):
            for feed in feeds:
                import_feed.delay(feed)
        self.wait_for("imports", lambda: len(self.runs("import")) >= 4, 20)
        time.sleep(1.0)
        runs = self.runs("import")
        worst = max_concurrent_per_key(runs)
        self.record("exclusive: max concurrent runs per key", str(worst), worst == 1)
        self.record(
            "exclusive: duplicates skipped (logged, not run)",
            f"{20 - len(runs)} of 20",
            4 <= len(runs) < 20,
        )

    def unique(self) -> None:
        from celery_baton.demo.app import build_report

        say("\n[2/6] unique: report 7 published 5 times while the first is queued or running")
        results = [build_report.delay(7) for _ in range(5)]
        self.wait_for("the report", lambda: len(self.runs("report")) >= 1, 20)
        time.sleep(1.5)
        runs = len(self.runs("report"))
        ids = {r.id for r in results}
        self.record("unique: runs of 5 publishes of one report", str(runs), runs == 1)
        self.record("unique: task ids the 5 publishes returned", str(len(ids)), len(ids) == 1)

    def rate(self) -> None:
        from celery_baton.demo.app import fetch

        say("\n[3/6] global rate limit 10/s: 30 fetches over 2 workers (4 pool slots)")
        for i in range(30):
            fetch.delay(i)
        self.wait_for("fetches", lambda: len(self.runs("fetch")) >= 30, 30)
        starts = sorted(r["start"] for r in self.runs("fetch"))
        achieved = (len(starts) - 1) / ((starts[-1] - starts[0]) / 1e6) if len(starts) > 1 else 0
        busiest = max_in_window(starts, 1_000_000)
        self.record(
            "rate: achieved rate across all workers",
            f"{achieved:.1f}/s",
            len(starts) == 30 and 9.0 <= achieved <= 10.5,
        )
        # GCRA with burst 1 lets one start come early: 10 in a second plus the burst.
        self.record(
            "rate: most starts in any 1 s window",
            f"{busiest} (<= 10 + burst 1)",
            busiest <= 11,
        )

    def concurrency(self) -> None:
        from celery_baton.demo.app import render

        say("\n[4/6] global concurrency 3: 12 renders over 4 pool slots")
        for i in range(12):
            render.delay(i)
        self.wait_for("renders", lambda: len(self.runs("render")) >= 12, 30)
        runs = self.runs("render")
        peak = max_concurrent_per_key(runs)
        self.record(
            "concurrency: most renders running at once",
            f"{peak} (cap 3)",
            len(runs) == 12 and peak <= 3,
        )

    def beat(self, started: float) -> None:
        say("\n[5/6] beat: 2 beat processes fire a 1 s entry; the leader is SIGKILLed")
        leader = self.leader_pid()
        killed_at = time.monotonic()
        victim = next((p for p in self.beats if p.pid == leader), None)
        if victim is None:
            self.record("beat: a leader was elected", "no leader found", False)
            return
        os.killpg(victim.pid, signal.SIGKILL)
        say(f"  killed the leader (pid {leader}); waiting for the other to take over")
        took_over = self.wait_for(
            "a new leader", lambda: self.leader_pid() not in (None, leader), 15
        )
        failover = time.monotonic() - killed_at
        time.sleep(3.0)
        ticks = self.runs("tick")
        counts = Counter(r["key"] for r in ticks)
        duplicates = sum(c - 1 for c in counts.values())
        self.record(
            "beat: failover after SIGKILL of the leader",
            f"{failover:.1f}s" if took_over else "none",
            took_over and failover < 10,
        )
        self.record(
            "beat: ticks fired / duplicates",
            f"{len(counts)} / {duplicates}",
            duplicates == 0 and len(counts) > 0,
        )

    def leader_pid(self) -> int | None:
        from celery_baton.beat.state import BeatKeys, schedule_name
        from celery_baton.demo.app import app

        owner = self.store.hget(BeatKeys(app=schedule_name(app.main)).leader, "owner")
        try:
            return int(str(owner).split(":")[1])
        except (IndexError, ValueError):
            return None

    def redelivery(self) -> None:
        from celery_baton.demo.app import charge

        say("\n[6/6] redelivery guard: one charge, then its message delivered again")
        task_id = str(uuid.uuid4())
        # The same message twice, as a broker redelivers it: its id and its publish
        # stamp (a new publish of the id, with a stamp of its own, would run again).
        copy = {"task_id": task_id, "headers": {PUBLISH_HEADER: uuid.uuid4().hex[:16]}}
        charge.apply_async((1,), **copy)
        self.wait_for("the charge", lambda: len(self.runs("charge")) >= 1, 15)
        charge.apply_async((1,), **copy)  # the same message again
        time.sleep(2.0)
        runs = len(self.runs("charge"))
        self.record("redelivery: runs of one task id delivered twice", str(runs), runs == 1)

    # -- the whole demo -------------------------------------------------------------

    def run(self) -> int:
        say(f"celery-baton {__version__} demo: real workers and beats on the embedded store\n")
        self.start_store()
        self.observer.delete("demo:runs")
        self.store.flushdb()
        # The demo knows its store is new: no grace before the first lease (a store that
        # is found without its data waits one lease_ttl; see docs/failure.md).
        self.store.set("baton:epoch", 0)
        for n in range(1, WORKERS + 1):
            self.spawn("worker", n)
        for n in range(1, BEATS + 1):
            self.beats.append(self.spawn("beat", n))
        say(f"  started {WORKERS} workers and {BEATS} beats (logs in {self.tmp})")
        ready = self.wait_for(
            "workers",
            lambda: len(cast(list[str], self.store.keys("baton:worker:*"))) >= WORKERS,
            40,
        )
        if not ready:
            raise RuntimeError(f"workers did not start; see logs in {self.tmp}")
        started = time.monotonic()
        self.wait_for("a beat leader", lambda: self.leader_pid() is not None, 15)
        self.exclusive()
        self.unique()
        self.rate()
        self.concurrency()
        self.beat(started)
        self.redelivery()
        return self.summary()

    def summary(self) -> int:
        width = max(len(r.guarantee) for r in self.results)
        say("\n" + "guarantee".ljust(width) + "  measured".ljust(22) + "  ok")
        say("-" * width + "  " + "-" * 20 + "  ----")
        for r in self.results:
            say(f"{r.guarantee.ljust(width)}  {r.measured.ljust(20)}  {'yes' if r.ok else 'NO'}")
        failed = [r for r in self.results if not r.ok]
        say(f"\n{'all guarantees held' if not failed else f'{len(failed)} guarantee(s) FAILED'}")
        return 1 if failed else 0


def max_concurrent_per_key(runs: list[dict[str, Any]]) -> int:
    worst = 0
    keys = {r["key"] for r in runs}
    for key in keys:
        events = sorted(
            [(r["start"], 1) for r in runs if r["key"] == key]
            + [(r["end"], -1) for r in runs if r["key"] == key],
            key=lambda e: (e[0], e[1]),
        )
        level = 0
        for _, step in events:
            level += step
            worst = max(worst, level)
    return worst


def max_in_window(starts: list[float], window: float) -> int:
    best, j = 0, 0
    for i, start in enumerate(starts):
        while starts[j] <= start - window:
            j += 1
        best = max(best, i - j + 1)
    return best


def main(*, keep_store: bool = False) -> int:
    demo = Demo()
    try:
        return demo.run()
    except KeyboardInterrupt:
        say("\ninterrupted: stopping every process the demo started")
        return 130
    except RuntimeError as exc:
        say(f"\ndemo failed: {exc}")
        return 2
    finally:
        demo.stop_all()
        if not keep_store:
            # Its own server only: never the user's shared one, even if the demo failed
            # before it started its own.
            stop_embedded_server(rdir=demo.tmp)
