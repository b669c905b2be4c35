"""Where a drain's CPU goes: one real worker, per process and per task.

    cd bench && PYTHONPATH=<checkout>/src python worker_profile.py [--tasks N] [options]

N no-op tasks (``noop_exclusive`` unless ``--task``) are published up front, then one
``celery worker`` (prefork, concurrency 2, as ``throughput.py``) drains them; the worker
runs the celery-baton that ``PYTHONPATH`` names, so two revisions can be compared. From
the worker's readiness to the last task it prints the CPU time per task (user and
system, from ``/proc``) of the worker's main process (the consumer: where admission and
release run), of its pool processes, and of the broker's and the store's servers, and
the store's commands per task (``INFO commandstats``). Options add, for the main
process:

* ``--perf``: its system calls per task (``perf stat`` on syscall tracepoints);
* ``--spy FILE``: a py-spy profile (``--format raw``: one stack per line and a count;
  idle samples left out, so the counts are CPU time);
* ``--cprofile FILE``: a cProfile of its loop thread (``pstats`` file): the exact number
  of Python calls per task, which the machine's noise does not move.

One drain is noisy on a shared machine; the per-task counts (calls, system calls, store
commands) are not.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
from pathlib import Path

from common import RedisServer, Worker, wait_for

SYSCALLS = ("sendto", "recvfrom", "write", "read", "poll", "epoll_wait", "epoll_ctl")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with open(task / "children") as f:
            found += [int(x) for x in f.read().split()]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=5000)
    parser.add_argument("--task", default="noop_exclusive")
    parser.add_argument("--plain", action="store_true", help="without celery-baton")
    parser.add_argument("--guard", action="store_true", help="baton_redelivery_guard on")
    parser.add_argument("--perf", action="store_true")
    parser.add_argument("--spy", default=None)
    parser.add_argument(
        "--spy-pool", default=None, help="a py-spy profile of the pool processes (FILE.<pid>)"
    )
    parser.add_argument("--cprofile", default=None)
    args = parser.parse_args()
    n = args.tasks
    with RedisServer() as broker, RedisServer() as store:
        os.environ["BENCH_BROKER_URL"] = broker.url
        os.environ["BENCH_STORE_URL"] = store.url
        from apps.throughput import app

        client = broker.client()
        store.client().set("baton:epoch", 0)  # a store known to be new (throughput.py)
        with app.producer_or_acquire() as producer:
            for i in range(n):
                app.send_task(args.task, (i,), producer=producer)
        env = {"BENCH_BROKER_URL": broker.url, "BENCH_STORE_URL": store.url}
        if args.plain:
            env["BENCH_BATON"] = "0"
        if args.guard:
            env["BENCH_GUARD"] = "1"
        if args.cprofile:
            env["BENCH_CPROFILE"] = str(Path(args.cprofile).resolve())
        worker = Worker("throughput", "profile", env=env)
        worker.start()
        assert worker.proc is not None
        pid = worker.proc.pid
        try:
            worker.wait_ready(client)
            servers = {"broker": broker.proc, "store": store.proc}
            pids = {name: [p.pid] for name, p in servers.items() if p is not None}
            pids["main"] = [pid]
            pids["pool"] = children(pid)
            before = {name: sum(cpu_seconds(p) for p in ps) for name, ps in pids.items()}
            started = int(client.get("bench:count") or 0)
            tool = None
            if args.perf and shutil.which("perf"):
                events = ",".join(f"syscalls:sys_enter_{name}" for name in SYSCALLS)
                tool = subprocess.Popen(
                    ["perf", "stat", "-x,", "-e", events, "-p", str(pid), "-o", "perf.tmp"],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            elif args.spy:
                spy = shutil.which("py-spy") or "py-spy"
                cmd = [spy, "record", "-p", str(pid), "--format", "raw", "-o", args.spy]
                tool = subprocess.Popen(
                    [*cmd, "-r", "200", "--nonblocking"],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            pool_spies = []
            if args.spy_pool:
                spy = shutil.which("py-spy") or "py-spy"
                for child in pids["pool"]:
                    out = f"{args.spy_pool}.{child}"
                    cmd = [spy, "record", "-p", str(child), "--format", "raw", "-o", out]
                    pool_spies.append(
                        subprocess.Popen(
                            [*cmd, "-r", "200", "--nonblocking"],
                            stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL,
                        )
                    )
            if not wait_for(lambda: int(client.get("bench:count") or 0) >= n, timeout=600):
                raise RuntimeError(f"only {client.get('bench:count')} of {n} ran")
            after = {name: sum(cpu_seconds(p) for p in ps) for name, ps in pids.items()}
            done = n - started
            first, last = float(client.get("bench:first")), float(client.get("bench:last"))
            commands = store.client().info("commandstats")
            broker_commands = client.info("commandstats")
            for spying in [tool, *pool_spies]:
                if spying is not None:
                    spying.send_signal(signal.SIGINT)
                    spying.wait(30)
        finally:
            worker.stop()
            errors = worker.check_log()
            if errors:
                print(f"worker errors:\n{errors[:1500]}")
    print(f"{args.task}: {n / (last - first):,.0f} tasks/s ({done} tasks measured)")
    print(
        "CPU us per task: "
        + ", ".join(f"{k} {(after[k] - before[k]) / done * 1e6:.0f}" for k in after)
    )
    for name, stat in sorted(commands.items()):
        if stat["calls"] >= n / 10:
            per_call = stat["usec_per_call"]
            print(f"store {name[8:]}: {stat['calls'] / n:.2f}/task, {per_call:.2f} us/call")
    for name, stat in sorted(broker_commands.items()):
        if stat["calls"] >= n / 10:
            print(f"broker {name[8:]}: {stat['calls'] / n:.2f}/task")
    if args.perf and Path("perf.tmp").exists():
        for line in Path("perf.tmp").read_text().splitlines():
            parts = line.split(",")
            if len(parts) > 2 and parts[0].strip().isdigit():
                name = parts[2].replace("syscalls:sys_enter_", "")
                print(f"main {name}: {int(parts[0]) / done:.2f}/task")
        Path("perf.tmp").unlink()


if __name__ == "__main__":
    main()
