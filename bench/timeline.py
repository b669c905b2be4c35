"""Where a drain's time goes between one task's end and the next task's start.

    cd bench && PYTHONPATH=<checkout>/src python timeline.py [--rounds N] [--task-ms MS]
        [--only 3,5] [--before SRC]

Drains the tasks of ``throughput.py`` (its variants, numbered as there; plain Celery and
celery-baton without options always) through one worker, prefork ``-c 2``, with the
hooks of ``timeline_hooks/sitecustomize.py`` in every process: each task's way through
the worker, timestamped on the one monotonic clock. For each pool process, between the
end of a task A and the start of the next task B it runs:

* ``post->post2``: the pool process, after the body (celery-baton's end of the run);
* ``post2->ready``: the result's way to the main process, until its pool reads READY;
* ``ready->succ``: the main process, from READY to ``Request.on_success`` (celery-baton
  hands the next waiting request to the pool in there);
* ``dispatch->pre``: from B handed to the pool (or A's READY, whichever is later) to B's
  start in its process;
* ``gap``: A's end to B's start, the whole of it.

Medians and 90th percentiles in ms, per variant, over every round. ``--before SRC``:
celery-baton's variants also drained by workers running that revision's ``src/``.

``--handoffs DIR``: read the files the hooks wrote into ``DIR`` while another benchmark
ran (``TIMELINE_DIR=DIR PYTHONPATH=bench/timeline_hooks:<checkout>/src python
handoff.py``): one key's runs one after the other, each hand-off cut the same way
(``post->ready`` split in ``post->post2`` and the rest), given apart for the next run on
the other worker and on the same one, the slowest five listed with the collections
(``gc``) that ended in any process while they lasted.
"""

from __future__ import annotations

import itertools
import os
import shutil
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

from common import BENCH_DIR, REPO_DIR, RedisServer, machine_note, parse_args, table
from throughput import VARIANTS, Variant, drain_once

HOOKS = BENCH_DIR / "timeline_hooks"
PARTS = ("post->post2", "post2->ready", "ready->succ", "dispatch->pre", "gap")


class Timeline(NamedTuple):
    """What the hooks wrote into one directory, times in ms."""

    events: dict[str, dict[str, float]]  # task id -> event -> when
    process: dict[str, dict[str, str]]  # task id -> event -> the pid that wrote it
    runs: list[list[str]]  # each pool process's tasks, in the order it ran them
    collections: list[tuple[float, str, str]]  # (end, "gcN <ms> ms", pid)


def read_events(where: Path) -> Timeline:
    events: dict[str, dict[str, float]] = defaultdict(dict)
    process: dict[str, dict[str, str]] = defaultdict(dict)
    runs: dict[str, list[tuple[float, str]]] = defaultdict(list)
    collections: list[tuple[float, str, str]] = []
    for path in where.glob("*.tl"):
        for line in path.read_text().splitlines():
            ns, event, task_id = line.split()
            at = int(ns) / 1e6
            if event.startswith("gc"):  # its duration in place of a task id
                collections.append((at, f"{event} {task_id} ms", path.stem))
                continue
            events[task_id][event] = at
            process[task_id][event] = path.stem
            if event == "pre":
                runs[path.stem].append((at, task_id))
    ordered = [[task_id for _, task_id in sorted(seq)] for seq in runs.values()]
    return Timeline(events, process, ordered, collections)


def parts_of(where: Path) -> dict[str, list[float]]:
    timeline = read_events(where)
    events, runs = timeline.events, timeline.runs
    parts: dict[str, list[float]] = defaultdict(list)
    for seq in runs:
        for a_id, b_id in itertools.pairwise(seq):
            a, b = events[a_id], events[b_id]
            if not {"post", "post2", "ready", "succ"} <= a.keys() or "exec" not in b:
                continue
            handed = max(b["exec"], a["ready"])
            parts["post->post2"].append(a["post2"] - a["post"])
            parts["post2->ready"].append(a["ready"] - a["post2"])
            parts["ready->succ"].append(a["succ"] - a["ready"])
            parts["dispatch->pre"].append(b["pre"] - handed)
            parts["gap"].append(b["pre"] - a["post"])
    return parts


def handoffs(where: Path) -> None:
    """The hand-offs of one key's runs, from the hooks' files in ``where``."""
    events, process, _, collections = read_events(where)
    runs = sorted(
        (e["pre"], task_id) for task_id, e in events.items() if {"pre", "post"} <= e.keys()
    )
    rows: list[tuple[bool, dict[str, float]]] = []
    for (_, a_id), (_, b_id) in itertools.pairwise(runs):
        a, b = events[a_id], events[b_id]
        if not {"post2", "ready", "succ"} <= a.keys() or "exec" not in b:
            continue
        same = process[a_id]["ready"] == process[b_id]["exec"]
        rows.append(
            (
                same,
                {
                    "hand-off": b["pre"] - a["post"],
                    "post->post2": a["post2"] - a["post"],
                    "post2->ready": a["ready"] - a["post2"],
                    "ready->succ": a["succ"] - a["ready"],
                    "succ->exec(next)": b["exec"] - a["succ"],
                    "exec->pre": b["pre"] - b["exec"],
                    "from": a["post"],
                    "to": b["pre"],
                },
            )
        )
    names = [
        "hand-off",
        "post->post2",
        "post2->ready",
        "ready->succ",
        "succ->exec(next)",
        "exec->pre",
    ]
    for same in (False, True):
        chosen = [parts for s, parts in rows if s is same]
        if not chosen:
            continue
        print(f"\n### to {'the same' if same else 'another'} worker: {len(chosen)} hand-offs\n")
        cells = []
        for name in names:
            values = sorted(parts[name] for parts in chosen)
            p99 = values[min(len(values) - 1, round(0.99 * (len(values) - 1)))]
            cells.append(
                [name, f"{statistics.median(values):.2f}", f"{p99:.2f}", f"{values[-1]:.2f}"]
            )
        print(table(["part", "p50 ms", "p99 ms", "max ms"], cells))
        print()
        for parts in sorted(chosen, key=lambda p: -p["hand-off"])[:5]:
            during = [
                f"{what} ({pid})"
                for t, what, pid in collections
                if parts["from"] <= t <= parts["to"]
            ]
            split = ", ".join(f"{name} {parts[name]:.2f}" for name in names)
            print(f"- {split}; collections: {', '.join(during) or 'none over 0.5 ms'}")


def with_hooks(variant: Variant, src: Path, tag: str, where: Path) -> Variant:
    path = os.pathsep.join([str(HOOKS), str(BENCH_DIR), str(src)])
    env = {**variant.env, "PYTHONPATH": path, "TIMELINE_DIR": str(where)}
    return variant._replace(label=f"{variant.label}{tag}", env=env)


def main() -> None:
    args = parse_args(
        __doc__ or "",
        tasks={"type": int, "default": 1000},
        only={"default": "3", "help": "throughput.py's variants (numbers 3-6)"},
        task_ms={"type": float, "default": 10.0, "help": "every task body sleeps this long"},
        before={"default": None, "help": "another revision's src/: drained beside"},
        handoffs={"default": None, "help": "read the hooks' files of a hand-off run"},
    )
    if args.handoffs:
        handoffs(Path(args.handoffs))
        return
    chosen = [VARIANTS[0], VARIANTS[1]] + [
        VARIANTS[i - 1] for i in sorted({int(i) for i in args.only.split(",")} - {1, 2})
    ]
    revisions = [("", REPO_DIR / "src")]
    if args.before:
        revisions.insert(0, (" [before]", Path(args.before).resolve()))
    scratch = Path(tempfile.mkdtemp(prefix="timeline-"))
    runs: list[tuple[Variant, Path]] = []
    for variant in chosen:
        for tag, src in revisions if variant is not VARIANTS[0] else revisions[-1:]:
            where = scratch / str(len(runs))
            where.mkdir()
            runs.append((with_hooks(variant, src, tag, where), where))
    rates: dict[str, list[float]] = defaultdict(list)
    with RedisServer() as broker, RedisServer() as store:
        os.environ["BENCH_BROKER_URL"] = broker.url
        os.environ["BENCH_STORE_URL"] = store.url
        for round_no in range(args.rounds or 2):
            for variant, _ in runs if round_no % 2 == 0 else runs[::-1]:
                rates[variant.label].append(
                    drain_once(broker, store, variant, args.tasks, args.task_ms)
                )
    print(f"## timeline: tasks sleeping {args.task_ms:g} ms, one worker (prefork, -c 2)\n")
    print(machine_note())
    print(f"{args.tasks} tasks per drain, {args.rounds or 2} round(s); ms, p50 / p90.\n")
    rows = []
    for variant, where in runs:
        parts = parts_of(where)
        cells = []
        for name in PARTS:
            values = sorted(parts[name])
            cells.append(
                f"{statistics.median(values):.3f} / {values[int(len(values) * 0.9)]:.3f}"
                if values
                else "-"
            )
        rows.append([variant.label, f"{statistics.median(rates[variant.label]):.0f}", *cells])
    print(table(["variant", "tasks/s", *PARTS], rows))
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
