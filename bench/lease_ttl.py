"""What a lease_ttl costs: renewal traffic, and whether a busy worker renews in time.

One worker of ``tests.apps.first_run`` (every default but ``baton_lease_ttl``), ``-c 2``:
one guarded task runs for the whole measurement (its lease is renewed every ttl/3),
first alone (the idle traffic: every command the worker sends the store, per second),
then beside a drain of short guarded tasks (distinct keys) that keeps the worker's main
process busy admitting, starting and releasing. Meanwhile the long run's lease is read
every 50 ms: the smallest time it had left (its deadline minus the store's clock) says
whether the renewals came in time; the worker's report gives renewals and losses.

    python bench/lease_ttl.py [--quick] [--ttls 10,30] [--drain 3000]
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import machine_note, parse_args, table  # noqa: E402
from tests.support.celery_processes import app_env, start_worker  # noqa: E402
from tests.support.servers import StoreServer  # noqa: E402


def _commands(server: StoreServer) -> int:
    with server.client() as r:
        return int(r.info("stats")["total_commands_processed"])


def _lease_left(server: StoreServer, task_id: str) -> float | None:
    """Seconds the lease of ``task_id`` has left (None: not held now)."""
    with server.client() as r:
        now_ms = int(r.time()[0]) * 1000 + int(r.time()[1]) // 1000
        for key in r.scan_iter(match="baton:*:ex:*", count=1000):
            for field, value in r.hgetall(key).items():
                if field.startswith(f"o:{task_id}|"):
                    return (int(value.split()[0]) - now_ms) / 1000
    return None


def measure(
    ttl: float, idle: float, drain: int, store: StoreServer, broker: StoreServer
) -> dict[str, float]:
    broker.flushall()
    store.flushall()  # declared new: no grace in the measurement
    env = app_env(store.url(), broker.url(0), broker.url(1), broker.url(2))
    env["FIRST_RUN_LEASE_TTL"] = str(ttl)
    worker = start_worker("tests.apps.first_run", env=env, concurrency=2)
    try:
        worker.wait_ready()
        os.environ.update({k: env[k] for k in ("TEST_BROKER_URL", "TEST_RESULT_URL")})
        os.environ.update(TEST_OBSERVER_URL=env["TEST_OBSERVER_URL"], BATON_URL=store.url())
        from tests.apps.first_run import guarded

        long_run = guarded.delay("long", idle + 600)
        while _lease_left(store, long_run.id) is None:
            time.sleep(0.05)
        before = _commands(store)
        time.sleep(idle)
        idle_rate = (_commands(store) - before) / idle

        least = [ttl]
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                left = _lease_left(store, long_run.id)
                if left is not None:
                    least[0] = min(least[0], left)
                time.sleep(0.05)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        began = time.monotonic()
        results = [guarded.delay(f"short-{n}", 0) for n in range(drain)]
        for result in results:
            result.get(timeout=600)
        drained = time.monotonic() - began
        time.sleep(ttl / 3 + 1)  # one more renewal after the drain
        stop.set()
        watcher.join()
        with store.client() as r:
            report = json.loads(next(iter(r.mget(list(r.scan_iter("baton:worker:*"))))))
        return {
            "ttl": ttl,
            "idle_calls": idle_rate,
            "drain_per_s": drain / drained,
            "drain_s": drained,
            "least_left": least[0],
            "renewals": report.get("renewals", 0),
            "losses": report.get("losses", 0),
        }
    finally:
        worker.kill()


def main() -> None:
    args = parse_args(
        __doc__ or "",
        ttls={"default": "10,30", "help": "lease_ttl values to measure"},
        drain={"type": int, "default": 3000, "help": "short guarded tasks drained"},
    )
    idle = 15.0 if args.quick else 60.0
    drain = 500 if args.quick else args.drain
    rows = []
    store, broker = StoreServer(name="bench-store"), StoreServer(name="bench-broker")
    store.start()
    broker.start()
    try:
        measured = [measure(float(t), idle, drain, store, broker) for t in args.ttls.split(",")]
    finally:
        store.close()
        broker.close()
    for m in measured:
        rows.append(
            [
                f"{m['ttl']:g} s",
                f"{m['idle_calls']:.2f}",
                f"{m['drain_per_s']:.0f}",
                f"{m['least_left']:.2f} s",
                int(m["renewals"]),
                int(m["losses"]),
            ]
        )
    print(machine_note())
    print(
        table(
            [
                "lease_ttl",
                "store commands/s, one idle worker holding a lease",
                "drain, tasks/s (-c 2)",
                "least lease time left",
                "renewals",
                "losses",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
