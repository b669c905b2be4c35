"""Shared harness for the benchmarks under ``bench/``.

* ``RedisServer``: a private ``redis-server`` on a free loopback port (never 6379).
* ``rate`` / ``compare``: run callables for a fixed time, interleaved over several
  rounds, and take the median ops/s of each (the machine is small and shared).
* ``SingleClientRun``: the rounds and the CPU layout of the single-client benchmarks.
* ``Worker``: a real ``celery worker`` subprocess on one of the apps in ``bench/apps``.
* ``table``: results as a markdown table.

Every benchmark is a script: ``python bench/<name>.py [--quick]``.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

BENCH_DIR = Path(__file__).resolve().parent
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


# -- the store / broker ----------------------------------------------------------------------


def redis_server_binary() -> str:
    binary = shutil.which("redis-server") or shutil.which("valkey-server")
    if binary is None:
        sys.exit("benchmarks need redis-server (or valkey-server) on PATH")
    return binary


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """A private ``redis-server`` on a free port, without persistence.

    >>> with RedisServer() as server:  # doctest: +SKIP
    ...     server.url  # 'redis://127.0.0.1:PORT/0'
    """

    def __init__(self, *, cpu: int | None = None) -> None:
        self.port = 0
        self.cpu = cpu  # pin the server to this CPU (see pin_client)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self, **kwargs: Any) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, decode_responses=True, **kwargs)

    def start(self) -> RedisServer:
        for _ in range(5):
            self.port = free_port()
            self.proc = subprocess.Popen(
                [
                    redis_server_binary(),
                    "--port",
                    str(self.port),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--daemonize",
                    "no",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            if self.cpu is not None:
                os.sched_setaffinity(self.proc.pid, {self.cpu})
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    self.client(socket_timeout=0.5).ping()
                    return self
                except redis.ConnectionError:
                    time.sleep(0.05)
            self.stop()
        raise RuntimeError("could not start redis-server")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- timing ----------------------------------------------------------------------------------


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


# -- celery workers --------------------------------------------------------------------------


class Worker:
    """A real ``celery worker`` process on ``bench/apps/<app>.py``.

    The apps read their URLs from the environment (``BENCH_BROKER_URL``,
    ``BENCH_STORE_URL``) and mark ``bench:ready:<hostname>`` in the broker's
    server when the worker is ready.
    """

    def __init__(
        self,
        app: str,
        name: str,
        *,
        env: dict[str, str],
        concurrency: int = 2,
        queues: str = "celery",
        pool: str = "prefork",
        extra: Sequence[str] = (),
    ) -> None:
        self.hostname = f"{name}@bench"
        self.cmd = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            f"apps.{app}",
            "worker",
            "-P",
            pool,
            "-c",
            str(concurrency),
            "-n",
            self.hostname,
            "-Q",
            queues,
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            "--loglevel",
            "WARNING",
            *extra,
        ]
        # The caller's PYTHONPATH after bench/: a worker runs the celery-baton the
        # benchmark runs (PYTHONPATH=<checkout>/src compares another revision's).
        path = [str(BENCH_DIR), *filter(None, [os.environ.get("PYTHONPATH")])]
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), **env}
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = Path(f"/tmp/bench-worker-{os.getpid()}-{name}.log")

    def start(self) -> Worker:
        log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            self.cmd, env=self.env, cwd=BENCH_DIR, stdout=log, stderr=subprocess.STDOUT
        )
        log.close()
        return self

    def wait_ready(self, client: redis.Redis, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if client.exists(f"bench:ready:{self.hostname}"):
                return
            if self.proc is not None and self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"worker {self.hostname} did not start; see {self.log_path}")

    def stop(self, *, cold: bool = False) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGQUIT if cold else signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def check_log(self) -> str:
        """ERROR lines of the worker's log (a benchmark that hides errors lies)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(line for line in text.splitlines() if "ERROR" in line or "Trace" in line)


def start_workers(workers: Sequence[Worker], client: redis.Redis) -> None:
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.wait_ready(client)


def stop_workers(workers: Sequence[Worker], *, cold: bool = False) -> None:
    for worker in workers:
        if worker.proc is not None and worker.proc.poll() is None:
            worker.proc.send_signal(signal.SIGQUIT if cold else signal.SIGTERM)
    for worker in workers:
        worker.stop(cold=cold)
        errors = worker.check_log()
        if errors:
            print(f"<!-- {worker.hostname} logged errors:\n{errors[:2000]}\n-->", file=sys.stderr)


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
