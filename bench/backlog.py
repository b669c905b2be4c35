"""Throughput of unrelated tasks on a worker that holds a backlog of throttled messages.

    python bench/backlog.py [--quick]

One ``celery worker`` (prefork, concurrency 2) consumes queue ``throttled``. With a
backlog, 1000 messages of a task limited to 1/m are published there first, and the
worker takes what it will (celery-baton holds them in the consumer, counted like ETA
messages; Celery's own ``rate_limit`` keeps them in its token bucket). Then N no-op
tasks are published to queue ``fast`` and the worker is told to consume it
(``control.add_consumer``); their rate is N / (first start .. last end). Without a
backlog, the same worker and the same N no-op tasks. Target (issue 3): ≥ 0.9x.

Celery's own ``rate_limit`` is run on a plain Celery worker (celery-baton not
installed); celery-baton's ``global_rate_limit`` on a worker with it installed.
"""

from __future__ import annotations

import os
import statistics
import time

from common import (
    RedisServer,
    Worker,
    machine_note,
    parse_args,
    table,
    verdict,
    wait_for,
)

TARGET = 0.9
BACKLOG = 1000
LIMITERS = [
    # label, throttled task, celery-baton installed
    ('celery-baton global_rate_limit="1/m"', "throttled_baton", True),
    ('Celery rate_limit="1/m"', "throttled_celery", False),
]


def run_once(
    broker: RedisServer,
    store: RedisServer,
    throttled: str | None,
    baton: bool,
    n: int,
    timeout: float,
) -> tuple[float, int, str]:
    """(no-op tasks/s, throttled messages the worker took, note)."""
    from apps.throughput import app

    client = broker.client()
    client.flushdb()
    store.client().flushdb()
    env = {
        "BENCH_BROKER_URL": broker.url,
        "BENCH_STORE_URL": store.url,
        "BENCH_BATON": "1" if baton else "0",
    }
    worker = Worker("throughput", "backlog", env=env, queues="throttled")
    worker.start()
    note = ""
    taken = 0
    try:
        worker.wait_ready(client)
        if throttled:
            with app.producer_or_acquire() as producer:
                for i in range(BACKLOG):
                    app.send_task(throttled, (i,), queue="throttled", producer=producer)
            # Wait until the worker took all of them, or stopped taking more.
            last, since = -1, time.monotonic()
            while time.monotonic() - since < 3.0:
                left = client.llen("throttled")
                if left == 0:
                    break
                if left != last:
                    last, since = left, time.monotonic()
                time.sleep(0.1)
            taken = BACKLOG - client.llen("throttled")
            time.sleep(0.5)
        with app.producer_or_acquire() as producer:
            for i in range(n):
                app.send_task("noop", (i,), queue="fast", producer=producer)
        started = time.monotonic()
        app.control.add_consumer("fast", destination=[worker.hostname], reply=True, timeout=10)

        def count() -> int:
            return int(client.get("bench:count") or 0)

        if wait_for(lambda: count() >= n, timeout=timeout, poll=0.05):
            first, last_end = float(client.get("bench:first")), float(client.get("bench:last"))
            rate = n / (last_end - first)
        else:
            done = count()
            rate = done / (time.monotonic() - started)
            note = f"only {done} of {n} no-op tasks ran in {timeout:g} s"
    finally:
        worker.stop(cold=True)
    return rate, taken, note


def main() -> None:
    args = parse_args(__doc__ or "", tasks={"type": int, "default": None})
    n = args.tasks or (600 if args.quick else 2000)
    rounds = args.rounds or (1 if args.quick else 2)
    timeout = 5.0 if args.quick else 20.0
    results: dict[tuple[str, bool], list[float]] = {}
    taken: dict[str, int] = {}
    notes: dict[str, str] = {}
    with RedisServer() as broker, RedisServer() as store:
        os.environ["BENCH_BROKER_URL"] = broker.url
        os.environ["BENCH_STORE_URL"] = store.url
        for _ in range(rounds):
            for label, task, baton in LIMITERS:
                for backlog in (False, True):
                    rate, took, note = run_once(
                        broker, store, task if backlog else None, baton, n, timeout
                    )
                    results.setdefault((label, backlog), []).append(rate)
                    if backlog:
                        taken[label] = took
                        if note:
                            notes[label] = note
    rows = []
    for label, _, _ in LIMITERS:
        without = statistics.median(results[(label, False)])
        with_backlog = statistics.median(results[(label, True)])
        rows.append(
            [
                label,
                f"{without:,.0f}",
                f"{with_backlog:,.0f}",
                verdict(with_backlog / without, TARGET),
                f"{taken[label]} of {BACKLOG}",
                notes.get(label, ""),
            ]
        )
    print(f"## backlog: unrelated no-op tasks beside {BACKLOG} throttled messages\n")
    print(
        f"{machine_note()}; one worker (prefork, concurrency 2), {n} no-op tasks, "
        f"{rounds} interleaved round(s), median.\n"
    )
    print(
        table(
            [
                "throttled task",
                "no-op tasks/s, no backlog",
                "no-op tasks/s, with backlog",
                "x without",
                "throttled messages taken by the worker",
                "note",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
