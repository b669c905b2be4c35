"""A small tenant behind a big one, on one shared cap: with ``fair_key`` and without.

    python bench/fairness.py [--quick] [--backlog N]

Three ``celery worker`` processes (threads pool, 2 each: 6 slots) share
``global_concurrency=4``; every task sleeps 50 ms. Tenant A publishes a backlog (2000,
``--quick``: 400), and once A runs, tenant B publishes 20. Measured for B: the time
from its publish to its last run's end, against B's 20 alone on idle workers; and how
many A runs started between B's publish and B's last start. B's first start shows how
long the workers took to fetch the A messages ahead of B's in the broker's queue (the
fair share can only start once B's messages are received). For A: the time to drain
the whole backlog (fairness must not waste slots). The cap is checked on the recorded
runs (local clock, one machine).
"""

from __future__ import annotations

import os
import time

from celery import Celery

from common import (
    BENCH_DIR,
    RedisServer,
    Worker,
    machine_note,
    parse_args,
    start_workers,
    stop_workers,
    table,
)

B_COUNT = 20
CAP = 4


def max_concurrent(runs: list[tuple[str, float, float]]) -> int:
    events = sorted([(s, 1) for _, s, _ in runs] + [(e, -1) for _, _, e in runs])
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def scenario(task: str, backlog: int) -> dict[str, float]:
    with RedisServer() as broker, RedisServer() as store:
        client = broker.client()
        env = {
            "BENCH_BROKER_URL": broker.url,
            "BENCH_STORE_URL": store.url,
            # The workers import celery-baton from $PYTHONPATH too (a worktree's src).
            "PYTHONPATH": os.pathsep.join(
                filter(None, [str(BENCH_DIR), os.environ.get("PYTHONPATH")])
            ),
        }
        workers = [
            Worker("fair", f"fair{i}", env=env, pool="threads", concurrency=2) for i in range(3)
        ]
        start_workers(workers, client)
        try:
            publisher = Celery("publisher", broker=broker.url)
            # A new store grants no lease for one lease_ttl (the grace after a store
            # lost its data, docs/failure.md): wait it out with one warm-up run.
            publisher.send_task(task, ("warm-up",))
            while client.llen("bench:runs") < 1:
                time.sleep(0.05)
            client.delete("bench:runs")
            total = backlog + B_COUNT
            with publisher.producer_or_acquire() as producer:
                for _ in range(backlog):
                    publisher.send_task(task, ("A",), producer=producer)
            if backlog:
                while client.llen("bench:runs") < CAP:
                    time.sleep(0.01)
            b_published = time.time()
            with publisher.producer_or_acquire() as producer:
                for _ in range(B_COUNT):
                    publisher.send_task(task, ("B",), producer=producer)
            deadline = time.monotonic() + 60 + backlog * 0.05
            while client.llen("bench:runs") < total and time.monotonic() < deadline:
                time.sleep(0.05)
            raw = client.lrange("bench:runs", 0, -1)
        finally:
            stop_workers(workers)
    runs = [(t, float(s), float(e)) for t, s, e in (line.split() for line in raw)]
    a = [r for r in runs if r[0] == "A"]
    b = [r for r in runs if r[0] == "B"]
    last_b_start = max(s for _, s, _ in b)
    return {
        "done": len(runs),
        "b_span": max(e for _, _, e in b) - b_published,
        "b_first": min(s for _, s, _ in b) - b_published,
        "overtaking": sum(b_published < s < last_b_start for _, s, _ in a),
        "a_span": (max(e for _, _, e in a) - min(s for _, s, _ in a)) if a else 0.0,
        "max_concurrent": max_concurrent(runs),
    }


def main() -> None:
    args = parse_args(__doc__ or "", backlog={"type": int, "default": None})
    backlog = args.backlog or (400 if args.quick else 2000)
    alone = scenario("fair_capped", 0)
    results = [
        ("B alone (no backlog)", alone, 0),
        (f'fair_key="tenant", A {backlog} first', scenario("fair_capped", backlog), backlog),
        (f"no fair_key (FIFO), A {backlog} first", scenario("fifo_capped", backlog), backlog),
    ]
    rows = []
    for label, r, n in results:
        rows.append(
            (
                label,
                f"{r['b_first']:.2f} s",
                f"{r['b_span']:.2f} s",
                f"{r['b_span'] / alone['b_span']:.1f}x",
                int(r["overtaking"]) if n else "-",
                f"{r['a_span']:.1f} s" if n else "-",
                f"{int(r['max_concurrent'])} (cap {CAP})",
                f"{int(r['done'])}/{n + B_COUNT}",
            )
        )
    print(
        table(
            [
                "scenario",
                "B's first start after publish",
                "B's 20 done after publish",
                "vs B alone",
                "A runs started before B's last",
                "A's backlog drained in",
                "max running",
                "runs",
            ],
            rows,
        )
    )
    print(f"\n{machine_note()}")


if __name__ == "__main__":
    main()
