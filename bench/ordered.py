"""Ordered keys: the hand-off to a key's next call, and the cost of order against
``exclusive_conflict="wait"`` (one at a time, no order).

    python bench/ordered.py [--quick] [--keys 20] [--calls 60] [--workers 3]

Three ``celery worker`` processes (prefork, concurrency 2 each, prefetch 4,
``acks_late``) are started and ready; then ``keys`` x ``calls`` calls are published,
interleaved by key, with bodies of 5-40 ms: under ``exclusive="key",
exclusive_conflict="wait"`` first (on the colder workers), then the same calls under
``ordered="key"`` on the same workers; then the hand-off alone: ``handoff`` calls of one
ordered key, 2 ms each, nothing else running: its first run holds the key until all are
published, so that this script's publish loop does not share the two CPUs with the
hand-offs timed (``--publish-beside``: timed during the publish, the method before
2026-11-29, whose p99 was the publisher's).
Each run records its body's start and end (one clock: every process runs on this
machine), its key, its place in its key's publish order and its worker.

Reported per workload: the whole run's time (first publish to last end), per-key inversions
(a run that started before an earlier-published call of its key) and overlaps, and the
hand-off: from a run's end (its body's last line) to the next run of its key's start,
apart for the next run on another worker and on the same one. Issue 38's bars: ordered
takes <= 1.1 x the time of "wait", hand-off p99 <= 10 ms to another worker.
"""

from __future__ import annotations

import itertools
import os
import statistics
import time
from collections import defaultdict
from typing import Any

from apps.base import PUBLISHING
from common import (
    RedisServer,
    Worker,
    machine_note,
    parse_args,
    start_workers,
    stop_workers,
    table,
    wait_for,
)

TARGET_P99_MS = 10.0
TARGET_RATIO = 1.1


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run_mode(
    app: Any,
    client: Any,
    task: str,
    keys: int,
    calls: int,
    fixed_ms: float = 0.0,
    hold: bool = False,
) -> dict[str, object]:
    """One workload on the running workers; its runs' numbers. ``hold``: the first run
    holds its key until every call is published (the hand-off alone is timed without
    this script's publish loop on the same CPUs)."""
    total = keys * calls
    client.delete("bench:runs")
    if hold:
        client.set(PUBLISHING, 1, ex=120)
    began = time.time()
    with app.producer_or_acquire() as producer:
        for n in range(calls):
            for k in range(keys):
                work_ms = fixed_ms or 5 + (n * 7 + k * 3) % 36
                app.send_task(task, (f"{task}-k{k}", n, work_ms), producer=producer)
    client.delete(PUBLISHING)
    if not wait_for(lambda: client.llen("bench:runs") >= total, timeout=120 + total * 0.05):
        raise RuntimeError(f"only {client.llen('bench:runs')} of {total} ran")
    lines = [line.split() for line in client.lrange("bench:runs", 0, -1)]
    runs = sorted((float(a), float(b), key, int(n), host) for a, b, key, n, host in lines)
    by_key: dict[str, list[tuple[float, float, str, int, str]]] = defaultdict(list)
    for run in runs:
        by_key[run[2]].append(run)
    inversions = overlaps = 0
    other: list[float] = []
    same: list[float] = []
    for key_runs in by_key.values():
        highest = -1
        for run in key_runs:
            inversions += run[3] < highest
            highest = max(highest, run[3])
        for (_, end, _, _, host), (start, _, _, _, next_host) in itertools.pairwise(key_runs):
            gap_ms = (start - end) * 1000
            overlaps += gap_ms < 0
            (same if host == next_host else other).append(gap_ms)
    return {
        "seconds": max(run[1] for run in runs) - began,
        "inversions": inversions,
        "overlaps": overlaps,
        "other": other,
        "same": same,
    }


def main() -> None:
    args = parse_args(
        __doc__ or "",
        keys={"type": int, "default": None},
        calls={"type": int, "default": None},
        workers={"type": int, "default": 3},
        handoff={"type": int, "default": None},
        publish_beside={"action": "store_true", "help": "time the hand-off during the publish"},
    )
    keys = args.keys or (8 if args.quick else 20)
    calls = args.calls or (20 if args.quick else 60)
    with RedisServer() as broker, RedisServer() as store:
        os.environ["BENCH_BROKER_URL"] = broker.url
        os.environ["BENCH_STORE_URL"] = store.url
        from apps.ordered import app

        client = broker.client()
        store.client().set("baton:epoch", 0)  # a store known to be new (throughput.py)
        env = {"BENCH_BROKER_URL": broker.url, "BENCH_STORE_URL": store.url}
        workers = [
            Worker("ordered", f"ordered{i}", env=env, concurrency=2) for i in range(args.workers)
        ]
        start_workers(workers, client)
        try:
            # The same workers, one workload after the other (each with keys of its own).
            results = {
                mode: run_mode(app, client, task, keys, calls)
                for mode, task in (("exclusive wait", "waiting_one"), ("ordered", "ordered_one"))
            }
            solo = args.handoff or (100 if args.quick else 400)
            results["ordered, one key alone"] = run_mode(
                app, client, "ordered_one", 1, solo, 2.0, hold=not args.publish_beside
            )
        finally:
            stop_workers(workers)
    rows = []
    for mode, r in results.items():
        other = r["other"]
        assert isinstance(other, list)
        rows.append(
            [
                mode,
                f"{r['seconds']:.2f}",
                r["inversions"],
                r["overlaps"],
                f"{statistics.median(other):.2f}" if other else "",
                f"{percentile(other, 0.99):.2f}" if other else "",
                f"{max(other):.2f}" if other else "",
            ]
        )
    ratio = float(results["ordered"]["seconds"]) / float(results["exclusive wait"]["seconds"])
    p99 = percentile(results["ordered, one key alone"]["other"], 0.99)  # type: ignore[arg-type]
    print(f"## ordered keys: {keys} keys x {calls} calls, {args.workers} workers\n")
    print(
        f"{machine_note()}; bodies of 5-40 ms; concurrency 2, prefetch 4, acks_late; wall "
        "clock (one machine's clock); hand-off: a run's last line to the next run of its "
        "key's first, on another worker.\n"
    )
    print(
        table(
            ["mode", "total s", "inversions", "overlaps", "hand-off p50 ms", "p99 ms", "max ms"],
            rows,
        )
    )
    print(
        f"\nordered / wait: {ratio:.2f} (bar <= {TARGET_RATIO}: "
        f"{'met' if ratio <= TARGET_RATIO else 'MISSED'}); hand-off p99 {p99:.2f} ms (bar <= "
        f"{TARGET_P99_MS:g}, one key alone: {'met' if p99 <= TARGET_P99_MS else 'MISSED'})"
    )


if __name__ == "__main__":
    main()
