"""Hand-off on one exclusive key: a run's end to the next run's start, across workers.

    python bench/handoff.py [--quick] [--tasks N] [--workers 2] [--work-ms 2]

Two ``celery worker`` processes (prefork, concurrency 1 each, Celery's default
prefetch) are started and ready; then N tasks of one ``exclusive=True,
exclusive_conflict="wait"`` task are published at once. Each run records its body's
start and end (one clock: every process runs on this machine) and its worker. A
hand-off is the time from one run's end (its body's last line) to the next run's start:
the run's result goes back to its worker's main process, which releases the key; the
store tells the waiting workers; one of them asks, is granted, and hands the request to
its pool process. Given apart for the next run on the other worker and on the same one.
Issue 36's bar: p99 ≤ 5 ms on another worker. No two runs may overlap (counted).

The first run holds the key until all N are published (``bench:publishing``), so that
the hand-offs timed do not share the two CPUs with this script's own publish loop;
``--publish-beside`` times them while it runs (the method before 2026-11-29: its p99 was
the publisher's, see docs/benchmarks.md#handoff).
"""

from __future__ import annotations

import itertools
import os
import statistics

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

TARGET_P99_MS = 5.0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    args = parse_args(
        __doc__ or "",
        tasks={"type": int, "default": None},
        workers={"type": int, "default": 2},
        work_ms={"type": float, "default": 2.0, "help": "each run's body sleeps this long"},
        publish_beside={"action": "store_true", "help": "time hand-offs during the publish"},
    )
    n = args.tasks or (100 if args.quick else 600)
    with RedisServer() as broker, RedisServer() as store:
        os.environ["BENCH_BROKER_URL"] = broker.url
        os.environ["BENCH_STORE_URL"] = store.url
        from apps.handoff import app

        client = broker.client()
        store.client().set("baton:epoch", 0)  # a store known to be new (throughput.py)
        env = {
            "BENCH_BROKER_URL": broker.url,
            "BENCH_STORE_URL": store.url,
            "BENCH_WORK_MS": f"{args.work_ms:g}",
        }
        workers = [
            Worker("handoff", f"handoff{i}", env=env, concurrency=1) for i in range(args.workers)
        ]
        start_workers(workers, client)
        try:
            if not args.publish_beside:
                client.set(PUBLISHING, 1, ex=120)
            with app.producer_or_acquire() as producer:
                for i in range(n):
                    app.send_task("handoff_one", (i,), producer=producer)
            client.delete(PUBLISHING)
            if not wait_for(lambda: client.llen("bench:runs") >= n, timeout=60 + n * 0.05):
                raise RuntimeError(f"only {client.llen('bench:runs')} of {n} ran")
            runs = sorted(
                (float(a), float(b), host)
                for a, b, host in (line.split() for line in client.lrange("bench:runs", 0, -1))
            )
        finally:
            stop_workers(workers)
    other, same = [], []
    overlaps = 0
    for (_, end, host), (start, _, next_host) in itertools.pairwise(runs):
        gap_ms = (start - end) * 1000
        overlaps += gap_ms < 0
        (same if host == next_host else other).append(gap_ms)
    rows = []
    for label, gaps in (("to another worker", other), ("to the same worker", same)):
        if not gaps:
            rows.append([label, 0, "", "", "", "", ""])
            continue
        rows.append(
            [
                label,
                len(gaps),
                f"{statistics.median(gaps):.2f}",
                f"{percentile(gaps, 0.9):.2f}",
                f"{percentile(gaps, 0.99):.2f}",
                f"{max(gaps):.2f}",
                f"{percentile(gaps, 0.99):.2f} (target ≤ {TARGET_P99_MS:g}: "
                f"{'met' if percentile(gaps, 0.99) <= TARGET_P99_MS else 'MISSED'})"
                if label == "to another worker"
                else "",
            ]
        )
    print(f"## hand-off: one exclusive key, {args.workers} workers (concurrency 1 each)\n")
    print(
        f"{machine_note()}; {n} runs of {args.work_ms:g} ms; wall clock (one machine's "
        f"clock), from a run's last line to the next run's first; overlapping runs: "
        f"{overlaps}; "
        + (
            "timed while the calls were published"
            if args.publish_beside
            else "published while the first run held the key"
        )
        + ".\n"
    )
    print(table(["hand-off", "count", "p50 ms", "p90 ms", "p99 ms", "max ms", "bar"], rows))


if __name__ == "__main__":
    main()
