"""No-op task throughput through one real worker, and the publish rate of ``unique``.

    python bench/throughput.py [--quick]

Drain: N no-op tasks are published up front, then one ``celery worker`` (prefork,
concurrency 2, redis broker on a private server, without gossip/mingle/heartbeat)
is started; the rate is N / (first task start .. last task end), from the tasks' own
records. Variants, interleaved over rounds (every other round in reverse order), each a
fresh worker; a ratio is the median of the per-round ratios:

* plain Celery (no celery-baton installed) — the baseline;
* celery-baton installed, the task has no option;
* ``exclusive="i"`` on distinct keys (one gate call before and one release after);
* ``global_rate_limit="1000000/s"`` (never binding; one gate call per task);
* ``baton_redelivery_guard = True`` on the plain task (gate call + done marker).

Publish: ``apply_async`` per second of a plain task vs a ``unique="i"`` task with
distinct keys, from one process, interleaved.

``--before SRC`` (another revision's ``src/``, e.g. a ``git worktree`` of it): every
celery-baton variant is drained twice per round, by workers running that revision and
by workers running this checkout (in alternating order), and a table gives this
checkout's rate over the other's, paired per round: before and after in the same run.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

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
    wait_for,
)

TARGET = 0.85

VARIANTS = [
    # label, task name, env
    ("plain Celery (no celery-baton)", "noop", {"BENCH_BATON": "0"}),
    ("celery-baton installed, no option", "noop", {}),
    ("exclusive (distinct keys)", "noop_exclusive", {}),
    ('global_rate_limit="1000000/s"', "noop_rate", {}),
    ("redelivery guard on", "noop", {"BENCH_GUARD": "1"}),
]


def with_revisions(
    variants: list[tuple[str, str, dict[str, str]]], before_src: Path
) -> tuple[list[tuple[str, str, dict[str, str]]], list[tuple[int, int]]]:
    """Each celery-baton variant twice, its workers on ``before_src`` and on this
    checkout's ``src/`` (next to each other, so a round measures them back to back);
    plain Celery once. Returns the variants and the (before, after) index pairs."""
    after_src = REPO_DIR / "src"
    out = [variants[0]]
    pairs = []
    for label, task, env in variants[1:]:
        for tag, src in (("before", before_src), ("after", after_src)):
            # Workers read PYTHONPATH (bench/servers.py): bench/ first, then the revision.
            path = os.pathsep.join([str(BENCH_DIR), str(src)])
            out.append((f"{label} [{tag}]", task, {**env, "PYTHONPATH": path}))
        pairs.append((len(out) - 2, len(out) - 1))
    return out, pairs


def drain_once(
    broker: RedisServer, store: RedisServer, task: str, env: dict[str, str], n: int
) -> float:
    """Publish ``n`` tasks, start a worker, return tasks/s from first start to last end."""
    from apps.throughput import app  # the publisher: same app, same routing

    client = broker.client()
    client.flushdb()
    store.client().flushdb()
    # A store known to be new: its first leases need not wait out the grace a store
    # that lost its data gets (gate.lua, "G"; ignored by revisions without it).
    store.client().set("baton:epoch", 0)
    with app.producer_or_acquire() as producer:
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
    from apps.throughput import noop, noop_unique

    counter = iter(range(10**9))

    def plain() -> None:
        noop.apply_async((next(counter),))

    def unique() -> None:
        noop_unique.apply_async((next(counter),))

    samples = compare(
        [("plain apply_async", plain), ("unique apply_async (distinct keys)", unique)],
        seconds=seconds,
        rounds=rounds,
    )
    broker.client().flushdb()
    store.client().flushdb()
    return samples


def main() -> None:
    args = parse_args(
        __doc__ or "",
        tasks={"type": int, "default": None},
        only={"default": None, "help": "drain only these variants (numbers 3-5, comma-separated)"},
        no_publish={"action": "store_true", "help": "skip the publish comparison"},
        before={"default": None, "help": "another revision's src/: drain it beside this one"},
    )
    variants = VARIANTS
    if args.only:
        # The baselines (plain Celery, celery-baton without options) always run.
        variants = VARIANTS[:2] + [VARIANTS[int(i) - 1] for i in args.only.split(",")]
    pairs: list[tuple[int, int]] = []  # (before, after) indexes into variants
    if args.before:
        variants, pairs = with_revisions(variants, Path(args.before).resolve())
    n = args.tasks or (600 if args.quick else 3000)
    rounds = args.rounds or (1 if args.quick else 5)
    seconds = args.seconds or 0.1
    with RedisServer() as broker, RedisServer() as store:
        os.environ["BENCH_BROKER_URL"] = broker.url
        os.environ["BENCH_STORE_URL"] = store.url
        samples = [Sample(label) for label, _, _ in variants]
        for round_no in range(rounds):
            # Every other round runs the variants in reverse order: a drain's position
            # in the round (the first one after flushing, say) must not favour a variant.
            order = list(zip(samples, variants, strict=True))
            if round_no % 2:
                order = order[::-1]
            for sample, (_, task, env) in order:
                sample.values.append(drain_once(broker, store, task, env, n))
        pub = (
            []
            if args.no_publish
            else publish_rates(broker, store, seconds, 20 if args.quick else 100)
        )
    print("## throughput: no-op tasks through one worker (prefork, concurrency 2)\n")
    print(
        f"{machine_note()}; {n} tasks per drain, {rounds} interleaved round(s), a fresh "
        "worker per drain; ratios are the median of the per-round ratios.\n"
    )
    print(ratio_table(samples, baseline=variants[0][0], unit="tasks/s"))
    print()
    rows = []
    for s in samples[2:]:
        rows.append(
            [
                s.name,
                verdict(paired_ratio(s, samples[0]), TARGET),
                f"{paired_ratio(s, samples[1]):.2f}",
            ]
        )
    print(table(["variant", "x plain Celery", "x celery-baton, no option"], rows))
    if pairs:
        print(f"\n## this checkout / {args.before} (same run, paired per round)\n")
        rows = []
        for before, after in pairs:
            ratios = paired_ratios(samples[after], samples[before])
            spread = f"{min(ratios):.2f}-{max(ratios):.2f}" if len(ratios) > 1 else ""
            rows.append([variants[after][0], f"{statistics.median(ratios):.3f}", spread])
        print(table(["variant", "after / before", "range"], rows))
    if not pub:
        return
    print("\n## publish rate: unique vs plain apply_async\n")
    print(ratio_table(pub, baseline="plain apply_async", unit="publishes/s"))
    print(f"\nunique / plain publish: {verdict(paired_ratio(pub[1], pub[0]), TARGET)}")


if __name__ == "__main__":
    main()
