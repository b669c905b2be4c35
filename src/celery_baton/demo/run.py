"""The demo's driver: real processes, one scenario per guarantee, a table at the end."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from celery_baton import __version__
from celery_baton.core.policy.headers import PUBLISH_HEADER
from celery_baton.demo.processes import Processes, say
from celery_baton.store.connection import stop_embedded_server

WORKERS = 2
BEATS = 2


@dataclass
class Result:
    guarantee: str
    measured: str
    ok: bool


class Demo:
    """One scenario per guarantee, judged from the runs the tasks record."""

    def __init__(self) -> None:
        self.processes = Processes()
        self.results: list[Result] = []

    def runs(self, kind: str) -> list[dict[str, Any]]:
        return [
            r
            for r in (
                json.loads(x)
                for x in cast(list[bytes], self.processes.observer.lrange("demo:runs", 0, -1))
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
        self.processes.wait_for("imports", lambda: len(self.runs("import")) >= 4, 20)
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
        self.processes.wait_for("the report", lambda: len(self.runs("report")) >= 1, 20)
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
        self.processes.wait_for("fetches", lambda: len(self.runs("fetch")) >= 30, 30)
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
        self.processes.wait_for("renders", lambda: len(self.runs("render")) >= 12, 30)
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
        victim = next((p for p in self.processes.beats if p.pid == leader), None)
        if victim is None:
            self.record("beat: a leader was elected", "no leader found", False)
            return
        os.killpg(victim.pid, signal.SIGKILL)
        say(f"  killed the leader (pid {leader}); waiting for the other to take over")
        took_over = self.processes.wait_for(
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

        owner = self.processes.store.hget(BeatKeys(app=schedule_name(app.main)).leader, "owner")
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
        self.processes.wait_for("the charge", lambda: len(self.runs("charge")) >= 1, 15)
        charge.apply_async((1,), **copy)  # the same message again
        time.sleep(2.0)
        runs = len(self.runs("charge"))
        self.record("redelivery: runs of one task id delivered twice", str(runs), runs == 1)

    # -- the whole demo -------------------------------------------------------------

    def run(self) -> int:
        say(f"celery-baton {__version__} demo: real workers and beats on the embedded store\n")
        self.processes.start_store()
        self.processes.observer.delete("demo:runs")
        self.processes.store.flushdb()
        # The demo knows its store is new: no grace before the first lease (a store that
        # is found without its data waits one lease_ttl; see docs/failure.md).
        self.processes.store.set("baton:epoch", 0)
        for n in range(1, WORKERS + 1):
            self.processes.spawn("worker", n)
        for n in range(1, BEATS + 1):
            self.processes.beats.append(self.processes.spawn("beat", n))
        say(f"  started {WORKERS} workers and {BEATS} beats (logs in {self.processes.tmp})")
        ready = self.processes.wait_for(
            "workers",
            lambda: len(cast(list[str], self.processes.store.keys("baton:worker:*"))) >= WORKERS,
            40,
        )
        if not ready:
            raise RuntimeError(f"workers did not start; see logs in {self.processes.tmp}")
        started = time.monotonic()
        self.processes.wait_for("a beat leader", lambda: self.leader_pid() is not None, 15)
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
    code = 2
    try:
        code = demo.run()
        return code
    except KeyboardInterrupt:
        say("\ninterrupted: stopping every process the demo started")
        code = 130
        return code
    except RuntimeError as exc:
        say(f"\ndemo failed: {exc}")
        return code
    finally:
        demo.processes.stop_all()
        _leave(demo.processes.tmp, demo.processes.sock, keep_store, code)


def _leave(tmp: Path, sock: Path | None, keep_store: bool, code: int) -> None:
    """Stop the demo's own server (never the user's shared one, even if the demo failed
    before it started its own) and remove its folder; or, with ``--keep-store``, say how
    to reach it and stop it. A failed run keeps its folder: the processes' logs are
    there."""
    if keep_store and sock is not None:
        say(
            f"\nthe embedded store still runs (--keep-store), on {sock}: point `celery "
            f"baton` at it with BATON_URL=unix://{sock}?db=15; stop it with "
            f"BATON_RUNTIME_DIR={tmp} python -m celery_baton stop-embedded"
        )
        return
    stop_embedded_server(rdir=tmp)
    if code == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        say(f"the processes' logs: {tmp}")
