"""Shared harness for the benchmarks under ``bench/``.

* ``rate`` / ``compare``: run callables for a fixed time, interleaved over several
  rounds, and take the median ops/s of each (the machine is small and shared).
* ``SingleClientRun``: the rounds and the CPU layout of the single-client benchmarks.
* ``table``: results as a markdown table.
* ``RedisServer``, ``Worker`` (a private ``redis-server``, a real ``celery worker``):
  defined in ``servers.py``, imported from here as well.

Every benchmark is a script: ``python bench/<name>.py [--quick]``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

# The scripts import these from here (``as``: re-exported).
if __package__:  # imported as bench.common (python -m bench.<script>)
    from .servers import BENCH_DIR as BENCH_DIR
    from .servers import RedisServer as RedisServer
    from .servers import Worker as Worker
    from .servers import free_port as free_port
    from .servers import redis_server_binary as redis_server_binary
    from .servers import start_workers as start_workers
    from .servers import stop_workers as stop_workers
else:  # python bench/<script>.py: bench/ is on sys.path
    from servers import BENCH_DIR as BENCH_DIR
    from servers import RedisServer as RedisServer
    from servers import Worker as Worker
    from servers import free_port as free_port
    from servers import redis_server_binary as redis_server_binary
    from servers import start_workers as start_workers
    from servers import stop_workers as stop_workers

REPO_DIR = BENCH_DIR.parent


# -- command line --------------------------------------------------------------------------


def parse_args(description: str, **extra: Any) -> argparse.Namespace:
    """``--quick`` for a short run; ``--rounds`` and ``--seconds`` override the defaults."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="a short run (~30 s or less)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds")
    parser.add_argument("--seconds", type=float, default=None, help="seconds per measurement")
    for name, kwargs in extra.items():
        parser.add_argument(f"--{name.replace('_', '-')}", **kwargs)
    return parser.parse_args()


def machine_note() -> str:
    cpus = os.cpu_count()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    git = ["git", "-C", str(REPO_DIR)]
    head = subprocess.run(
        [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    dirty = subprocess.run(
        [*git, "status", "--porcelain", "--", "src"], capture_output=True, text=True, check=False
    ).stdout.strip()
    commit = f"celery-baton at {head or '?'}{' + uncommitted src changes' if dirty else ''}, "
    return (
        f"{commit}{platform.machine()}, {cpus} CPUs, Python {platform.python_version()}, "
        f"{redis_server_version()}, loopback TCP; client, server (and workers) share the "
        f"CPUs; load average at the end {load}"
    )


def redis_server_version() -> str:
    out = subprocess.run(
        [redis_server_binary(), "--version"], capture_output=True, text=True, check=False
    ).stdout
    for part in out.split():
        if part.startswith("v="):
            return f"redis-server {part[2:]}"
    return out.strip()


# -- timing ----------------------------------------------------------------------------------


def version_of(package: str) -> str:
    """An installed package's version, or "not installed"."""
    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def rate(fn: Callable[[], object], seconds: float, batch: int = 50) -> float:
    """Calls per second of ``fn`` over about ``seconds`` (whole batches, no warm-up)."""
    calls = 0
    start = time.perf_counter()
    deadline = start + seconds
    while True:
        for _ in range(batch):
            fn()
        calls += batch
        now = time.perf_counter()
        if now >= deadline:
            return calls / (now - start)


@dataclass
class Sample:
    """The ops/s of one candidate over the rounds of one run."""

    name: str
    values: list[float] = field(default_factory=list)
    note: str = ""

    @property
    def median(self) -> float:
        return statistics.median(self.values) if self.values else float("nan")

    @property
    def spread(self) -> str:
        if len(self.values) < 2:
            return ""
        return f"{min(self.values):,.0f}-{max(self.values):,.0f}"


def pinned_pair() -> tuple[int | None, int | None]:
    """CPUs for a single-client benchmark: (client, server) on two different CPUs.

    Left to the scheduler, the client and the server sometimes share a CPU and
    sometimes not, and the round-trip rate of either layout differs by a third: the
    rounds then measure placement, not the code. Pinned, every candidate runs in the
    same layout. (None, None) on a machine with one CPU."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None, None
    return cpus[0], cpus[1]


def pin_client(cpu: int | None) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})


@dataclass
class SingleClientRun:
    """How a single-client benchmark (locks, limits) runs: many short interleaved
    rounds, this process and its server pinned to two different CPUs (``pinned_pair``)."""

    seconds: float
    rounds: int
    client_cpu: int | None
    server_cpu: int | None

    @classmethod
    def start(cls, args: argparse.Namespace) -> SingleClientRun:
        """The settings from the command line; pins this process at once."""
        client_cpu, server_cpu = pinned_pair()
        pin_client(client_cpu)
        rounds = args.rounds or (20 if args.quick else 100)
        return cls(args.seconds or 0.1, rounds, client_cpu, server_cpu)

    def server(self) -> RedisServer:
        return RedisServer(cpu=self.server_cpu)

    def note(self) -> str:
        return (
            f"{machine_note()}; client on CPU {self.client_cpu}, server on CPU "
            f"{self.server_cpu}; {self.rounds} interleaved rounds x {self.seconds:g} s; "
            "ratios are the median of the per-round ratios.\n"
        )


def compare(
    candidates: Sequence[tuple[str, Callable[[], object]]],
    *,
    seconds: float,
    rounds: int,
    warmup: float = 0.2,
) -> list[Sample]:
    """Each candidate for ``seconds``, round-robin over ``rounds``; medians are reported."""
    samples = [Sample(name) for name, _ in candidates]
    for _, fn in candidates:
        rate(fn, warmup, batch=10)
    for _ in range(rounds):
        for sample, (_, fn) in zip(samples, candidates, strict=True):
            sample.values.append(rate(fn, seconds, batch=10))
    return samples


def paired_ratios(sample: Sample, base: Sample) -> list[float]:
    """``sample / base`` per round: each round measures both back to back, so the
    machine's slow and fast spells (other work on shared CPUs) cancel out."""
    return [v / b for v, b in zip(sample.values, base.values, strict=True)]


def paired_ratio(sample: Sample, base: Sample) -> float:
    """The median of the per-round ratios: the number every verdict uses."""
    return statistics.median(paired_ratios(sample, base))


def ratio_table(samples: Sequence[Sample], *, baseline: str, unit: str = "ops/s") -> str:
    """A markdown table: median ops/s, the range over rounds, and the ratio to
    ``baseline`` (the median of the per-round ratios, with their range)."""
    base = next(s for s in samples if s.name == baseline)
    rows = []
    for s in samples:
        ratios = paired_ratios(s, base)
        spread = f"{min(ratios):.2f}-{max(ratios):.2f}" if len(ratios) > 1 else ""
        rows.append(
            [s.name, f"{s.median:,.0f}", s.spread, f"{paired_ratio(s, base):.2f}", spread, s.note]
        )
    return table(
        ["candidate", f"{unit} (median)", "range", f"x {baseline}", "ratio range", "note"], rows
    )


def table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(str(cell) for cell in row) + " |")
    return "\n".join(lines)


def verdict(value: float, target: float) -> str:
    return f"{value:.2f} (target ≥ {target}: {'met' if value >= target else 'MISSED'})"


def wait_for(predicate: Callable[[], bool], timeout: float, poll: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(poll)
    return predicate()


def max_in_window(times: Sequence[float], window: float = 1.0) -> int:
    """The largest number of ``times`` (seconds) inside any half-open window of length
    ``window`` (a two-pointer sweep over the sorted times)."""
    ordered = sorted(times)
    best = 0
    lo = 0
    for hi, t in enumerate(ordered):
        while t - ordered[lo] >= window:
            lo += 1
        best = max(best, hi - lo + 1)
    return best


def import_package(name: str) -> Any:
    """Import the installed package ``name`` even though a script in ``bench/`` has the
    same name (``bench/limits.py`` would otherwise shadow the ``limits`` package)."""
    import importlib

    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCH_DIR]
    try:
        return importlib.import_module(name)
    finally:
        sys.path[:] = saved
