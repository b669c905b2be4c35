"""The beat through a Sentinel master change: celery-baton beside celery-redbeat.

One Sentinel setup (1 master, 1 replica, 3 sentinels; down-after 1 s), started from
``redis-server``/``redis-sentinel`` as the test fixtures do. For each scheduler: one
worker, two ``celery beat`` processes on the Sentinel store, one entry every 1 s. After
5 s the master changes, by ``SENTINEL FAILOVER`` (planned) or by SIGKILL of the master;
then 15 s more. Each run of the entry is recorded by the worker (the observer's server
clock). Per run, over the window from 5 s before the change to 15 s after it:

* resume: from the change to the first run after it (s);
* longest gap between two consecutive runs (s; 1.0 when nothing stalls);
* missed ticks: celery-baton's runs name their slot, so slots with no run (from the
  first slot in the window to its end); celery-redbeat's do not, so for each gap
  longer than 1.5 s (to the next run, or to the end of the window) the whole seconds
  it skipped;
* ticks run twice: celery-baton, slots with more than one run; celery-redbeat, runs
  less than 0.5 s after the previous one;
* beats alive at the end (a beat that exits stops scheduling for good).

    python bench/failover.py [--quick] [--runs 3]

celery-redbeat is configured for Sentinel as its README says (``redis-sentinel://``
URL, ``redbeat_redis_options`` with ``sentinels`` and ``service_name``), with its lock
at 6 s (celery-baton's beat lease) and ``beat_max_loop_interval`` 1 s; once with its
defaults otherwise, once with ``retry_period`` (its option to retry store errors
instead of raising them). Needs ``pip install celery-redbeat`` (benchmark only).
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import RedisServer, machine_note, parse_args, table  # noqa: E402
from tests.beat.helpers import beat_env  # noqa: E402
from tests.support.celery_processes import app_env, start_beat, start_worker  # noqa: E402
from tests.support.observer import Observer  # noqa: E402
from tests.support.sentinel_topology import SERVICE, SentinelTopology  # noqa: E402

APP = "tests.apps.beat_app"
BEFORE, AFTER = 5.0, 15.0


def _redbeat(topology: SentinelTopology, **extra: Any) -> dict[str, Any]:
    hosts = [["127.0.0.1", s.port] for s in topology.sentinels]
    first = topology.sentinels[0].port
    return {
        "redbeat_redis_url": f"redis-sentinel://127.0.0.1:{first}/0",
        "redbeat_redis_options": {
            "sentinels": hosts,
            "service_name": SERVICE,
            "socket_timeout": 1,
            **extra,
        },
        "redbeat_lock_timeout": 6,
        "beat_max_loop_interval": 1,
    }


def schedulers(topology: SentinelTopology) -> dict[str, tuple[str, dict[str, Any]]]:
    return {
        "celery-baton (lease 6 s)": ("celery_baton.beat:Scheduler", {}),
        "celery-redbeat (lock 6 s)": ("redbeat.RedBeatScheduler", _redbeat(topology)),
        "celery-redbeat (lock 6 s, retry_period 60)": (
            "redbeat.RedBeatScheduler",
            _redbeat(topology, retry_period=60),
        ),
    }


def server_us(server: RedisServer) -> int:
    with server.client() as r:
        seconds, micros = r.time()
    return int(seconds) * 1_000_000 + int(micros)


def wait_new_master(topology: SentinelTopology, old: object, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if topology.master() is not old:
                return
        except Exception:  # a sentinel mid-election may not answer
            pass
        time.sleep(0.05)
    raise RuntimeError(f"the sentinels named no new master within {timeout} s")


def one_run(
    topology: SentinelTopology,
    broker: RedisServer,
    scheduler: str,
    conf: dict[str, Any],
    how: str,
    run: int,
) -> dict[str, Any]:
    topology.wait_healthy()
    topology.flushall()
    logs = Path(tempfile.mkdtemp(prefix="bench-failover-"))
    observer_url = broker.url.replace("/0", "/2")
    env = app_env(topology.url(), broker.url, broker.url.replace("/0", "/1"), observer_url)
    env.update(beat_env({"every1": {"every": 1}}))
    env["BEAT_CONF"] = json.dumps(conf)
    observer = Observer(observer_url)
    with broker.client() as r:
        r.flushall()
    worker = start_worker(APP, env=env, concurrency=2, log_dir=logs)
    worker.wait_ready()
    beats = [start_beat(APP, env=env, scheduler=scheduler, log_dir=logs) for _ in "ab"]
    try:
        for beat in beats:
            beat.wait_started()
        time.sleep(BEFORE)
        old = topology.master()
        changed = server_us(broker)
        if how == "failover":
            topology.failover()
        else:
            old.kill()
        wait_new_master(topology, old)
        time.sleep(AFTER)
        alive = sum(b.is_running for b in beats)
    finally:
        for beat in beats:
            beat.stop(timeout=5)
        time.sleep(2)  # the last sends run
        worker.stop(timeout=5)
    started = [s for s in observer.started() if str(s["key"]).startswith("every1|")]
    observer.close()
    low, high = changed - BEFORE * 1e6, changed + AFTER * 1e6
    window = sorted(s["start"] for s in started if low <= s["start"] <= high)
    after = [t for t in window if t > changed]
    gaps = [(b - a) / 1e6 for a, b in itertools.pairwise(window)]
    slots = Counter(
        int(str(s["key"]).split("|")[1])
        for s in started
        if not str(s["key"]).endswith("|None") and low <= s["start"] <= high
    )
    if slots:  # celery-baton: each run names its slot (ms): count per slot
        first, last = min(slots), max(slots)
        missed = (last - first) // 1000 + 1 - len(slots)
        missed += max(0, round((high / 1000 - last) / 1000) - 1)  # none at the end
        duplicated = sum(n - 1 for n in slots.values())
    else:  # celery-redbeat: runs name no slot: count by the gaps between them
        ends = [*window, high]  # no run until the end of the window: all missed
        missed = sum(round((b - a) / 1e6) - 1 for a, b in itertools.pairwise(ends) if b - a > 1.5e6)
        duplicated = sum(1 for g in gaps if g < 0.5)
    result = {
        "resume": (after[0] - changed) / 1e6 if after else None,
        "gap": max(gaps) if gaps else None,
        "missed": missed,
        "duplicated": duplicated,
        "alive": alive,
        "logs": str(logs),
    }
    print(f"  {how} run {run}: {result}", flush=True)
    return result


def _fmt(values: list[float | None]) -> str:
    done = [v for v in values if v is not None]
    if not done:
        return "none after the change"
    shown = f"{statistics.median(done):.2f} / {max(done):.2f}"
    return shown if len(done) == len(values) else f"{shown} ({len(values) - len(done)} never)"


def main() -> None:
    args = parse_args(
        __doc__ or "", runs=dict(type=int, default=3, help="runs per scheduler and change")
    )
    runs = 1 if args.quick else args.runs
    topology = SentinelTopology()
    rows = []
    with RedisServer() as broker:
        try:
            topology.start()
            for label, (scheduler, conf) in schedulers(topology).items():
                for how in ("failover", "sigkill"):
                    print(f"{label}, {how}:", flush=True)
                    results = [
                        one_run(topology, broker, scheduler, conf, how, n + 1) for n in range(runs)
                    ]
                    rows.append(
                        (
                            label,
                            "SENTINEL FAILOVER" if how == "failover" else "master SIGKILL",
                            _fmt([r["resume"] for r in results]),
                            _fmt([r["gap"] for r in results]),
                            ", ".join(str(r["missed"]) for r in results),
                            ", ".join(str(r["duplicated"]) for r in results),
                            ", ".join(f"{r['alive']}/2" for r in results),
                        )
                    )
        finally:
            topology.close()
    print()
    headers = [
        "scheduler",
        "change",
        "resume (s), median / worst",
        "longest gap (s), median / worst",
        "ticks missed, per run",
        "ticks twice, per run",
        "beats alive after",
    ]
    print(table(headers, rows))
    print()
    print(f"Machine: {machine_note()}")


if __name__ == "__main__":
    main()
