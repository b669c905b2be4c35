"""Beat at scale: 10,000 entries, 100 due slots per second.

One in-process ``celery_baton.beat.Scheduler`` (the leader) against a private
redis-server store, publishing for real to a redis-server broker. Every entry runs
every 100 s, phase-shifted by 10 ms, so 100 slots fall due each second. Reports the
scheduler's CPU per second of wall time, the store server's CPU, the store memory
per entry, and the lag from each slot to the return of its publish call (store clock).
For comparison, the store memory of the same 10,000 entries under celery-redbeat.

    python bench/beat_scale.py [--quick] [--seconds 60]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from celery import Celery  # noqa: E402

from bench.common import RedisServer, machine_note, parse_args, table  # noqa: E402
from celery_baton.beat import Scheduler  # noqa: E402
from celery_baton.beat.entries import CompiledEntry  # noqa: E402

ENTRIES = 10_000
PERIOD = 100.0  # seconds: 10,000 entries / 100 s = 100 due slots per second


class TimedScheduler(Scheduler):
    lags: list[int]

    def publish(self, compiled: CompiledEntry, slot_ms: int, task_id: str, **options: Any) -> Any:
        result = super().publish(compiled, slot_ms, task_id, **options)
        self.lags.append(self.now_ms() - slot_ms)
        return result


def make_app(store: RedisServer, broker: RedisServer, scheduler: str) -> Celery:
    app = Celery("scale", broker=broker.url, set_as_current=False)
    app.conf.update(
        baton_url=store.url,
        redbeat_redis_url=store.url,
        timezone="UTC",
        result_expires=None,
        beat_scheduler=scheduler,
    )

    @app.task(name="bench.noop", shared=False)
    def noop(*args: Any) -> None:
        pass

    app.conf.beat_schedule = {
        f"entry-{i:05d}": {"task": "bench.noop", "schedule": PERIOD, "args": (i,)}
        for i in range(ENTRIES)
    }
    return app


def used_memory(server: RedisServer) -> int:
    with server.client() as r:
        return int(r.info("memory")["used_memory"])


def server_cpu(server: RedisServer) -> float:
    with server.client() as r:
        info = r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def baton(seconds: float) -> dict[str, Any]:
    with RedisServer() as store, RedisServer() as broker:
        app = make_app(store, broker, "celery_baton.beat:Scheduler")
        base = used_memory(store)
        s = TimedScheduler(app)
        s.lags = []
        started = time.perf_counter()
        s.tick()  # leads, defines 10,000 entries
        sync_s = time.perf_counter() - started
        memory = (used_memory(store) - base) / ENTRIES
        # Stagger the slots: 100 per second from 3 s from now (a real fleet of entries
        # is spread like this; defined at once they would all share one phase).
        keys = s._beat.keys  # type: ignore[union-attr]
        with store.client() as r:
            now = s.now_ms()
            pipe = r.pipeline(transaction=False)
            for i in range(ENTRIES):
                pipe.hset(keys.entry(f"entry-{i:05d}"), "next", now + 3000 + i * 10)
            pipe.incr(keys.version)
            pipe.execute()
        s._renew_at = 0.0
        s.tick()  # notices the version change, reloads
        time.sleep(max(0.0, (now + 3000 - s.now_ms()) / 1000))
        cpu0, store0, wall0 = time.process_time(), server_cpu(store), time.perf_counter()
        while time.perf_counter() - wall0 < seconds:
            time.sleep(s.tick())
        wall = time.perf_counter() - wall0
        cpu = (time.process_time() - cpu0) / wall
        store_cpu = (server_cpu(store) - store0) / wall
        with store.client() as r:
            entry_bytes = int(r.memory_usage(keys.entry("entry-00001")) or 0)
            history = keys.history("entry-00001")
            before = int(r.memory_usage(history) or 0)
            lines = r.llen(history)
        s.close()
        # The first 2 s of slots are warm-up (the reload that staggered them).
        lags = sorted(s.lags[200:])
        return {
            "sync_s": sync_s,
            "memory": memory,
            "entry_bytes": entry_bytes,
            "history_bytes": before,
            "history_lines": lines,
            "cpu": cpu,
            "store_cpu": store_cpu,
            "sent": len(s.lags),
            "rate": len(s.lags) / wall,
            "p50": statistics.median(lags),
            "p99": lags[int(len(lags) * 0.99) - 1],
            "max": lags[-1],
        }


def redbeat_memory() -> float:
    from redbeat import RedBeatScheduler

    with RedisServer() as store, RedisServer() as broker:
        app = make_app(store, broker, "redbeat.RedBeatScheduler")
        base = used_memory(store)
        scheduler = RedBeatScheduler(app, lock_key=None)
        memory = (used_memory(store) - base) / ENTRIES
        scheduler.close()
        return memory


def main() -> None:
    args = parse_args(__doc__ or "")
    seconds = args.seconds or (20.0 if args.quick else 60.0)
    r = baton(seconds)
    rb = redbeat_memory()
    print(
        table(
            ["measure (10,000 entries, 100 due slots/s)", "celery-baton"],
            [
                ("first sync: lead + define all entries", f"{r['sync_s']:.2f} s"),
                ("slots sent", f"{r['sent']} in {seconds:.0f} s ({r['rate']:.1f}/s)"),
                ("slot -> publish returned, p50 (after 2 s warm-up)", f"{r['p50']:.0f} ms"),
                ("slot -> publish returned, p99", f"{r['p99']:.0f} ms"),
                ("slot -> publish returned, max", f"{r['max']:.0f} ms"),
                ("scheduler CPU", f"{r['cpu'] * 100:.1f} % of one core"),
                ("store server CPU", f"{r['store_cpu'] * 100:.1f} % of one core"),
                ("store memory per entry, defined (INFO used_memory)", f"{r['memory']:.0f} B"),
                ("MEMORY USAGE of one entry hash", f"{r['entry_bytes']} B"),
                (
                    "MEMORY USAGE of its history list",
                    f"{r['history_bytes']} B for {r['history_lines']} lines "
                    "(bounded by baton_beat_history, default 20)",
                ),
            ],
        )
    )
    print()
    print(
        table(
            ["store memory per entry, defined (INFO used_memory)", "bytes", "ratio"],
            [
                ("celery-baton", f"{r['memory']:.0f}", "1.00"),
                ("celery-redbeat 2.4.2", f"{rb:.0f}", f"{rb / r['memory']:.2f}"),
            ],
        )
    )
    print()
    print(f"Machine: {machine_note()}")


if __name__ == "__main__":
    main()
