"""Drains of no-op tasks through one real worker, and the publish rate of ``unique``.

    python bench/throughput.py [--quick] [--rounds N] [--task-ms MS] [--only 3,4]
    python bench/throughput.py --publish-only          # the unique publish alone

Drain: N tasks are published up front, then one ``celery worker`` (prefork,
concurrency 2, redis broker on a private server, without gossip/mingle/heartbeat) is
started; the rate is N / (first task start .. last task end), from the tasks' own
records. Variants, interleaved over rounds (every other round in reverse order), each a
fresh worker; a ratio is the median of the per-round ratios:

1. plain Celery (no celery-baton installed): the baseline;
2. celery-baton installed, the task has no option;
3. ``exclusive="i"`` on distinct keys (one gate call before and one release after);
4. ``global_rate_limit="1000000/s"`` (never binding; one gate call per task);
5. ``global_concurrency=1000`` (never binding; a gate call and a release per task);
6. ``baton_redelivery_guard = True`` on the plain task (gate call + done marker);
7. celery-once's ``QueueOnce`` and 8. celery-singleton's ``Singleton`` (the ``bench``
   extra), each on plain Celery: the lock taken at the publish, freed at the run's end.

What differs between two variants is the option, nothing else: every message is
published by the same app (celery-baton's publisher, so every message carries the same
headers), by name, or through ``apply_async`` where the library locks there (7, 8); the
task bodies are the same function (``apps/throughput.py``); each worker is started the
same way, its environment differing only in what the variant names.

``--task-ms MS``: every task's body sleeps MS ms (every variant alike): a drain of short
real tasks, where a guarded start's round trip must hide behind the work.

Publish: ``apply_async`` per second of a plain task vs a ``unique="i"`` task with
distinct keys, from one process, interleaved; with the ``bench`` extra, celery-once's and
celery-singleton's locking ``apply_async`` beside (each a lock round trip per publish,
as ``unique``).

``--before SRC`` (another revision's ``src/``, e.g. a ``git worktree`` of it): every
celery-baton variant is drained twice per round, by workers running that revision and
by workers running this checkout (in alternating order), and a table gives this
checkout's rate over the other's, paired per round: before and after in the same run.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from common import (
    BENCH_DIR,
    REPO_DIR,
    RedisServer,
    Sample,
    Worker,
    compare,
    machine_note,
    paired_ratio,
    paired_ratios,
    parse_args,
    ratio_table,
    table,
    verdict,
    version_of,
    wait_for,
)

# Issue 36's bars, x plain Celery (medians of the per-round ratios):
TARGET = 0.95  # every guarded no-op drain, and the unique publish
TARGET_NO_OPTION = 0.98  # celery-baton installed, the task without an option
TARGET_SHORT_TASKS = 0.98  # every variant, with --task-ms 10

try:
    import celery_once  # noqa: F401
    import celery_singleton  # noqa: F401

    OTHERS_INSTALLED = True
except ImportError:
    OTHERS_INSTALLED = False


class Variant(NamedTuple):
    label: str
    task: str
    env: dict[str, str]
    published_by_task: bool = False  # through the task's apply_async (where it locks)
    other_library: bool = False  # not celery-baton: drained beside it, once per round
    bar: float = TARGET  # x plain Celery (0: none, another library's drain)


VARIANTS = [
    Variant("plain Celery (no celery-baton)", "noop", {"BENCH_BATON": "0"}),
    Variant("celery-baton installed, no option", "noop", {}, bar=TARGET_NO_OPTION),
    Variant("exclusive (distinct keys)", "noop_exclusive", {}),
    Variant('global_rate_limit="1000000/s"', "noop_rate", {}),
    Variant("global_concurrency=1000", "noop_concurrency", {}),
    Variant("redelivery guard on", "noop", {"BENCH_GUARD": "1"}),
    Variant(
        f"celery-once QueueOnce ({version_of('celery-once')})",
        "noop_once",
        {"BENCH_BATON": "0"},
        published_by_task=True,
        other_library=True,
        bar=0.0,
    ),
    Variant(
        f"celery-singleton Singleton ({version_of('celery-singleton')})",
        "noop_singleton",
        {"BENCH_BATON": "0"},
        published_by_task=True,
        other_library=True,
        bar=0.0,
    ),
]


def with_revisions(
    variants: list[Variant], before_src: Path
) -> tuple[list[Variant], list[tuple[int, int]]]:
    """Each celery-baton variant twice, its workers on ``before_src`` and on this
    checkout's ``src/`` (next to each other, so a round measures them back to back);
    plain Celery and the other libraries once. Returns the variants and the (before,
    after) index pairs."""
    after_src = REPO_DIR / "src"
    out = [variants[0]]
    pairs = []
    for variant in variants[1:]:
        if variant.other_library:
            out.append(variant)
            continue
        for tag, src in (("before", before_src), ("after", after_src)):
            # Workers read PYTHONPATH (bench/servers.py): bench/ first, then the revision.
            path = os.pathsep.join([str(BENCH_DIR), str(src)])
            env = {**variant.env, "PYTHONPATH": path}
            out.append(variant._replace(label=f"{variant.label} [{tag}]", env=env))
        pairs.append((len(out) - 2, len(out) - 1))
    return out, pairs


def drain_once(
    broker: RedisServer, store: RedisServer, variant: Variant, n: int, task_ms: float
) -> float:
    """Publish ``n`` tasks, start a worker, return tasks/s from first start to last end."""
    from apps.throughput import app  # the publisher: same app, same routing

    task, env = variant.task, {**variant.env, "BENCH_TASK_MS": f"{task_ms:g}"}

    client = broker.client()
    client.flushdb()
    store.client().flushdb()
    # A store known to be new: its first leases need not wait out the grace a store
    # that lost its data gets (gate.lua, "G"; ignored by revisions without it).
    store.client().set("baton:epoch", 0)
    with app.producer_or_acquire() as producer:
        if variant.published_by_task:  # the library's lock is taken in its apply_async
            publish = app.tasks[task].apply_async
            for i in range(n):
                publish((i,), producer=producer)
        else:
            for i in range(n):
                app.send_task(task, (i,), producer=producer)
    worker = Worker(
        "throughput",
        "drain",
        env={
            "BENCH_BROKER_URL": broker.url,
            "BENCH_STORE_URL": store.url,
            **env,
        },
    )
    worker.start()
    try:
        worker.wait_ready(client)
        if not wait_for(lambda: int(client.get("bench:count") or 0) >= n, timeout=120):
            raise RuntimeError(f"{task}: only {client.get('bench:count')} of {n} ran")
        first, last = float(client.get("bench:first")), float(client.get("bench:last"))
    finally:
        worker.stop()
        errors = worker.check_log()
        if errors:
            print(f"<!-- worker errors ({task}):\n{errors[:1500]}\n-->")
    return n / (last - first)


def publish_rates(broker: RedisServer, store: RedisServer, seconds: float, rounds: int) -> list:
    os.environ["BENCH_BROKER_URL"] = broker.url
    os.environ["BENCH_STORE_URL"] = store.url
    from apps import throughput as apps

    counter = iter(range(10**9))

    def publisher(task: object) -> Callable[[], None]:
        return lambda: task.apply_async((next(counter),))  # type: ignore[attr-defined]

    candidates = [
        ("plain apply_async", publisher(apps.noop)),
        ("unique apply_async (distinct keys)", publisher(apps.noop_unique)),
    ]
    if OTHERS_INSTALLED:  # the two libraries that also lock at the publish, beside
        candidates += [
            ("celery-once QueueOnce apply_async", publisher(apps.noop_once)),
            ("celery-singleton Singleton apply_async", publisher(apps.noop_singleton)),
        ]
    samples = compare(candidates, seconds=seconds, rounds=rounds)
    broker.client().flushdb()
    store.client().flushdb()
    return samples


def main() -> None:
    args = parse_args(
        __doc__ or "",
        tasks={"type": int, "default": None},
        only={"default": None, "help": "drain only these variants (numbers 3-8, comma-separated)"},
        task_ms={"type": float, "default": None, "help": "every task body sleeps this long"},
        no_publish={"action": "store_true", "help": "skip the publish comparison"},
        publish_only={"action": "store_true", "help": "only the publish comparison"},
        before={"default": None, "help": "another revision's src/: drain it beside this one"},
    )
    variants = [v for v in VARIANTS if not v.other_library or OTHERS_INSTALLED]
    if not OTHERS_INSTALLED:
        print("<!-- celery-once / celery-singleton not installed (the bench extra): left out -->")
    if args.only:
        # The baselines (plain Celery, celery-baton without options) always run.
        # (1 and 2 given again are not drained twice.)
        chosen = sorted({int(i) for i in args.only.split(",")} - {1, 2})
        variants = VARIANTS[:2] + [VARIANTS[i - 1] for i in chosen]
    pairs: list[tuple[int, int]] = []  # (before, after) indexes into variants
    if args.before:
        variants, pairs = with_revisions(variants, Path(args.before).resolve())
    n = args.tasks or (600 if args.quick else 3000)
    rounds = args.rounds or (1 if args.quick else 6)
    seconds = args.seconds or 0.1
    task_ms = args.task_ms or 0.0
    if args.publish_only:
        with RedisServer() as broker, RedisServer() as store:
            pub = publish_rates(broker, store, seconds, 20 if args.quick else 100)
        print_publish(pub)
        return
    with RedisServer() as broker, RedisServer() as store:
        os.environ["BENCH_BROKER_URL"] = broker.url
        os.environ["BENCH_STORE_URL"] = store.url
        samples = [Sample(v.label) for v in variants]
        for round_no in range(rounds):
            # Every other round runs the variants in reverse order: a drain's position
            # in the round (the first one after flushing, say) must not favour a variant.
            order = list(zip(samples, variants, strict=True))
            if round_no % 2:
                order = order[::-1]
            for sample, variant in order:
                sample.values.append(drain_once(broker, store, variant, n, task_ms))
        pub = (
            []
            if args.no_publish or task_ms
            else publish_rates(broker, store, seconds, 20 if args.quick else 100)
        )
    work = f"tasks sleeping {task_ms:g} ms" if task_ms else "no-op tasks"
    print(f"## throughput: {work} through one worker (prefork, concurrency 2)\n")
    print(
        f"{machine_note()}; {n} tasks per drain, {rounds} interleaved round(s), a fresh "
        "worker per drain; ratios are the median of the per-round ratios (wall clock: "
        "first start to last end).\n"
    )
    print(ratio_table(samples, baseline=variants[0].label, unit="tasks/s"))
    print()
    rows = []
    for sample, variant in zip(samples[1:], variants[1:], strict=True):
        ratio = paired_ratio(sample, samples[0])
        bar = TARGET_SHORT_TASKS if task_ms and variant.bar else variant.bar
        rows.append(
            [
                sample.name,
                verdict(ratio, bar) if bar else f"{ratio:.2f}",
                f"{paired_ratio(sample, samples[1]):.2f}",
            ]
        )
    print(table(["variant", "x plain Celery", "x celery-baton, no option"], rows))
    if pairs:
        print(f"\n## this checkout / {args.before} (same run, paired per round)\n")
        rows = []
        for before, after in pairs:
            ratios = paired_ratios(samples[after], samples[before])
            spread = f"{min(ratios):.2f}-{max(ratios):.2f}" if len(ratios) > 1 else ""
            rows.append([variants[after].label, f"{statistics.median(ratios):.3f}", spread])
        print(table(["variant", "after / before", "range"], rows))
    if pub:
        print_publish(pub)


def print_publish(pub: list) -> None:
    print("\n## publish rate: unique vs plain apply_async\n")
    print(ratio_table(pub, baseline="plain apply_async", unit="publishes/s"))
    print(f"\nunique / plain publish: {verdict(paired_ratio(pub[1], pub[0]), TARGET)}")


if __name__ == "__main__":
    main()
