"""Batching: one task per item, celery-batches, and celery-baton's ``batch=``, side by side.

    python bench/batching.py [--quick] [--rounds N] [--items N] [--paced N] [--rate R]
                             [--results] [--workers 1,3] [--concurrency 2]
                             [--variants plain,batches,baton]

A full run (3000 items, 2 rounds) takes about 3 minutes, ``--quick`` (1000 items, 1
round) about 1 minute; celery-batches comes from the ``bench-batches`` extra (it needs
Celery < 5.7), and is left out, said so, when it is not installed.

The same work in every variant: N items, 1 ms each (``time.sleep(0.001 * len(items))``
per body), published by name with ``kwargs={"doc": i}`` by one app (celery-baton's
publisher, so every message carries the same headers) on one Redis broker; results
ignored (no result backend), or with ``--results`` stored in a Redis result backend by
every variant (``apps/batching.py`` says how each writes them):

1. plain Celery, one task per item (no celery-baton in the worker): the anchor;
2. celery-batches' ``Batches`` (``flush_every=100, flush_interval=1``), on plain Celery,
   with ``worker_prefetch_multiplier=0`` as its docs ask;
3. celery-baton's ``batch=True, batch_size=100, batch_wait=1.0``.

Each through 1 and through 3 ``celery worker`` processes (prefork, concurrency 2, as
the other benchmarks), fresh for each measurement, in rounds (every other round in
reverse order). A measurement has two phases on the same workers:

* **drain**: the workers are started on an idle queue and ready; N items are published
  to the task queue, then every worker is told to consume it at once (``add_consumer``);
  items/s = N / (the first item's receipt by a worker .. the last body's end), from the
  consumers' and the bodies' own records (one machine, one clock): the receiving, the
  waiting for a batch and the running all count. (Not from the moment they are told:
  a consumer starts reading the queue it was given when its outstanding ``BRPOP`` on
  the idle queue times out, kombu's 1 s, so 0-1 s passes that is no variant's work; the
  table shows it apart.) Ratios to plain are the median of the per-round ratios.
* **paced**: then M more items published at R per second (below every variant's
  capacity): the flush latency is an item's publish to its body's start (p50, p99).

Of every run (a body's call), the items it held and which workers had received them
(``task_received`` in each worker's consumer): the mean batch size, how many batches
were full (100), and how many held items received by more than one worker.
Every item must run exactly once (counted; a lost or doubled item is printed).
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from common import (
    RedisServer,
    Worker,
    machine_note,
    parse_args,
    start_workers,
    stop_workers,
    table,
    version_of,
    wait_for,
)

TARGET = 5.0  # issue 37: celery-baton's batch >= 5 x plain per-task items/s (1 ms items)
BATCH_SIZE = 100
ITEM_S = 0.001  # each item's work (apps/batching.py)
IDLE_QUEUE = "bench.idle"


class Variant(NamedTuple):
    label: str
    task: str
    env: dict[str, str]


PLAIN = Variant("plain Celery, one task per item", "item_plain", {"BENCH_BATON": "0"})
BATCHES = Variant(
    f"celery-batches {version_of('celery-batches')}",
    "item_batches",
    {"BENCH_BATON": "0", "BENCH_PREFETCH": "0"},
)
BATON = Variant("celery-baton batch=True", "item_baton", {})


@dataclass
class Run:
    """One body's call: when, where, and its items."""

    start: float
    end: float
    node: str
    docs: list[int]


@dataclass
class Cell:
    """One variant through one number of workers, over the rounds."""

    variant: Variant
    workers: int
    rates: list[float] = field(default_factory=list)  # drain items/s, per round
    drain_runs: list[Run] = field(default_factory=list)
    paced_runs: list[Run] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)  # paced, seconds
    spanning_items: int = 0  # items of runs that held items of several workers
    spanning_runs: int = 0
    bad: list[str] = field(default_factory=list)  # lost or doubled items
    waits: list[float] = field(default_factory=list)  # told to consume .. first receipt, s


def read_runs(client: object, start: int = 0) -> list[Run]:
    lines = client.lrange("bench:runs", start, -1)  # type: ignore[attr-defined]
    runs = []
    for line in lines:
        s, e, node, docs = line.split()
        runs.append(Run(float(s), float(e), node, [int(d) for d in docs.split(",")]))
    return runs


class Counter:
    """The items recorded so far (read incrementally from the list)."""

    def __init__(self, client: object) -> None:
        self.client = client
        self.runs: list[Run] = []
        self.items = 0

    def poll(self) -> int:
        new = read_runs(self.client, len(self.runs))
        self.runs.extend(new)
        self.items += sum(len(r.docs) for r in new)
        return self.items


def check_once(runs: list[Run], expected: range) -> list[str]:
    seen: dict[int, int] = {}
    for run in runs:
        for doc in run.docs:
            seen[doc] = seen.get(doc, 0) + 1
    lost = [d for d in expected if d not in seen]
    twice = [d for d, n in seen.items() if n > 1]
    out = []
    if lost:
        out.append(f"{len(lost)} lost (first {lost[:5]})")
    if twice:
        out.append(f"{len(twice)} ran more than once (first {sorted(twice)[:5]})")
    return out


def measure(
    broker: RedisServer,
    store: RedisServer,
    cell: Cell,
    *,
    items: int,
    paced: int,
    rate: float,
    results: bool,
    concurrency: int,
) -> None:
    """One fresh set of workers: the drain, then the paced phase (see the docstring)."""
    from apps.batching import app  # the publisher

    client = broker.client()
    client.flushall()
    store.client().flushdb()
    store.client().set("baton:epoch", 0)  # a store known to be new (throughput.py)
    env = {
        "BENCH_BROKER_URL": broker.url,
        "BENCH_STORE_URL": store.url,
        "BENCH_RESULTS": "1" if results else "0",
        **cell.variant.env,
    }
    tag = cell.variant.task.split("_")[1]
    workers = [
        Worker(
            "batching",
            f"{tag}{i}",
            env={**env, "BENCH_NODE": f"w{i}"},
            queues=IDLE_QUEUE,
            concurrency=concurrency,
        )
        for i in range(cell.workers)
    ]
    start_workers(workers, client)
    counter = Counter(client)
    try:
        with app.producer_or_acquire() as producer:
            for i in range(items):
                app.send_task(cell.variant.task, kwargs={"doc": i}, producer=producer)
        told = time.time()  # the drain's start: every worker is told to consume now
        replies = app.control.add_consumer(
            "celery", destination=[w.hostname for w in workers], reply=True, timeout=10
        )
        if len(replies) != len(workers):
            raise RuntimeError(f"add_consumer: {len(replies)} of {len(workers)} replied")
        if not wait_for(lambda: counter.poll() >= items, timeout=60 + items / 20, poll=0.1):
            raise RuntimeError(f"{cell.variant.task}: only {counter.items} of {items} ran")
        published = []
        with app.producer_or_acquire() as producer:
            began = time.perf_counter()
            for j in range(paced):
                delay = began + j / rate - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                published.append(time.time())
                app.send_task(cell.variant.task, kwargs={"doc": items + j}, producer=producer)
        total = items + paced
        if not wait_for(lambda: counter.poll() >= total, timeout=30 + paced / 20, poll=0.1):
            raise RuntimeError(f"{cell.variant.task}: only {counter.items} of {total} ran")
        time.sleep(0.3)  # anything that runs twice shows up
        counter.poll()
        received: dict[int, set[str]] = {}
        first_received = float("inf")
        for line in client.lrange("bench:received", 0, -1):
            doc, node, at = line.split()
            received.setdefault(int(doc), set()).add(node)
            if int(doc) < items:
                first_received = min(first_received, float(at))
    finally:
        stop_workers(workers)
    runs = counter.runs
    cell.bad += check_once(runs, range(total))
    drain_runs = [r for r in runs if r.docs[0] < items]
    paced_runs = [r for r in runs if r.docs[0] >= items]
    # From the first item's receipt: a worker told to consume a queue starts reading it
    # when its outstanding BRPOP on the queues it had times out (kombu: 1 s), 0-1 s
    # that is no variant's work and counted against the fastest the most.
    cell.rates.append(items / (max(r.end for r in drain_runs) - first_received))
    cell.waits.append(first_received - told)
    cell.drain_runs += drain_runs
    cell.paced_runs += paced_runs
    for run in paced_runs:
        cell.latencies += [run.start - published[doc - items] for doc in run.docs]
    for run in runs:
        nodes = set().union(*(received.get(doc, set()) for doc in run.docs))
        if len(nodes) > 1:
            cell.spanning_runs += 1
            cell.spanning_items += len(run.docs)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def batch_stats(runs: list[Run]) -> str:
    if not runs:
        return ""
    sizes = [len(r.docs) for r in runs]
    full = sum(s >= BATCH_SIZE for s in sizes)
    return f"{statistics.mean(sizes):.1f} ({len(runs)} runs, {full} full)"


def main() -> None:
    args = parse_args(
        __doc__ or "",
        items={"type": int, "default": None, "help": "items per drain"},
        paced={"type": int, "default": None, "help": "items of the paced phase"},
        rate={"type": float, "default": 200.0, "help": "items/s of the paced phase"},
        results={"action": "store_true", "help": "results stored (Redis backend)"},
        workers={"default": "1,3", "help": "worker counts, comma-separated"},
        concurrency={"type": int, "default": 2, "help": "pool processes per worker"},
        variants={"default": "plain,batches,baton", "help": "of plain,batches,baton"},
    )
    named = {"plain": PLAIN, "batches": BATCHES, "baton": BATON}
    variants = [PLAIN] + [named[v] for v in args.variants.split(",") if v != "plain"]
    if BATCHES in variants and version_of("celery-batches") == "not installed":
        print("<!-- celery-batches not installed (pip install celery-batches): left out -->")
        variants.remove(BATCHES)
    items = args.items or (1000 if args.quick else 3000)
    paced = args.paced or (200 if args.quick else 400)
    rounds = args.rounds or (1 if args.quick else 2)
    counts = [int(n) for n in args.workers.split(",")]
    cells = {(v.task, n): Cell(v, n) for n in counts for v in variants}
    began = time.monotonic()
    with RedisServer() as broker, RedisServer() as store:
        os.environ["BENCH_BROKER_URL"] = broker.url
        os.environ["BENCH_STORE_URL"] = store.url
        os.environ["BENCH_RESULTS"] = "1" if args.results else "0"
        for round_no in range(rounds):
            order = [cells[(v.task, n)] for n in counts for v in variants]
            if round_no % 2:
                order = order[::-1]
            for cell in order:
                measure(
                    broker,
                    store,
                    cell,
                    items=items,
                    paced=paced,
                    rate=args.rate,
                    results=args.results,
                    concurrency=args.concurrency,
                )
    took = time.monotonic() - began
    stored = "results stored (Redis backend)" if args.results else "results ignored"
    print(f"## batching: {items} items of 1 ms, {stored}\n")
    print(
        f"{machine_note()}; workers prefork, concurrency {args.concurrency} each, fresh per "
        f"measurement; Celery {version_of('celery')}, kombu {version_of('kombu')}, "
        f"redis-py {version_of('redis')}; "
        f"{rounds} interleaved round(s); drain of {items} items, then {paced} items paced "
        f"at {args.rate:g}/s; the run took {took:.0f} s.\n"
    )
    rows = []
    for n in counts:
        base = cells[(PLAIN.task, n)]
        for v in variants:
            cell = cells[(v.task, n)]
            ratios = [r / b for r, b in zip(cell.rates, base.rates, strict=True)]
            spread = f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else ""
            runs = cell.drain_runs + cell.paced_runs
            rows.append(
                [
                    v.label,
                    n,
                    f"{statistics.median(cell.rates):,.0f}",
                    f"{statistics.median(ratios):.2f}{spread}",
                    f"{percentile(cell.latencies, 0.5) * 1000:,.0f}",
                    f"{percentile(cell.latencies, 0.99) * 1000:,.0f}",
                    batch_stats(cell.drain_runs),
                    batch_stats(cell.paced_runs),
                    f"{cell.spanning_runs} of {len(runs)} ({cell.spanning_items} items)",
                    f"{statistics.median(cell.waits) * 1000:,.0f}",
                    "; ".join(cell.bad) or "none",
                ]
            )
    print(
        table(
            [
                "variant",
                "workers",
                "drain items/s",
                "x plain (range)",
                "paced latency p50 ms",
                "p99 ms",
                "drain: mean batch (runs, full)",
                "paced: mean batch (runs, full)",
                "runs holding items of several workers",
                "told to first receipt ms (not timed)",
                "lost / twice",
            ],
            rows,
        )
    )
    print()
    for n in counts:
        cell, base = cells[(BATON.task, n)], cells[(PLAIN.task, n)]
        ratio = statistics.median(r / b for r, b in zip(cell.rates, base.rates, strict=True))
        met = "met" if ratio >= TARGET else "MISSED"
        # The work alone: every pool process asleep in a body all the time.
        ceiling = n * args.concurrency / ITEM_S
        print(
            f"celery-baton / plain, {n} worker(s): {ratio:.2f} (target ≥ {TARGET:g}: {met}); "
            f"the work alone bounds a drain at {ceiling:,.0f} items/s ({n} x "
            f"{args.concurrency} processes x 1 ms items), "
            f"{ceiling / statistics.median(base.rates):.1f} x plain's median"
        )


if __name__ == "__main__":
    main()
