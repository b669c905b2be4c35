"""Beat failover after SIGKILL of the leader: celery-baton beside celery-redbeat.

Three ``celery beat`` processes per scheduler, a 1 s interval entry, one worker. The
leader (the beat whose log last said "Sending due task") is SIGKILLed; the failover
time is from the kill to the first run of the entry that starts afterwards (worker
side, the observer's server clock), i.e. until a new leader publishes again. Each kill
is followed by starting a replacement beat. Waits are capped (``--cap``): redbeat's
default lock timeout is ``5 * beat_max_loop_interval`` = 1500 s.

    python bench/beat_failover.py [--quick] [--kills 3] [--cap 90]

Needs ``pip install celery-redbeat`` (benchmark only).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import RedisServer, machine_note, parse_args, table  # noqa: E402
from tests.beat.helpers import beat_env  # noqa: E402
from tests.support.celery_processes import (  # noqa: E402
    BeatProcess,
    WorkerProcess,
    app_env,
    start_beat,
    start_worker,
)
from tests.support.observer import Observer  # noqa: E402

APP = "tests.apps.beat_app"
SCHEDULERS: dict[str, tuple[str, dict[str, Any]]] = {
    "celery-baton (defaults: lease 6 s)": ("celery_baton.beat:Scheduler", {}),
    "celery-redbeat (defaults)": ("redbeat.RedBeatScheduler", {}),
    "celery-redbeat (beat_max_loop_interval=5, lock 25 s)": (
        "redbeat.RedBeatScheduler",
        {"beat_max_loop_interval": 5},
    ),
}


def sends(beat: BeatProcess) -> int:
    return beat.log_text().count("Sending due task")


def current_leader(beats: list[BeatProcess], window: float = 2.5) -> BeatProcess | None:
    before = {b.pid: sends(b) for b in beats if b.is_running}
    time.sleep(window)
    for b in beats:
        if b.is_running and sends(b) > before.get(b.pid, 0):
            return b
    return None


def server_us(server: RedisServer) -> int:
    with server.client() as r:
        seconds, micros = r.time()
    return int(seconds) * 1_000_000 + int(micros)


def measure(scheduler: str, conf: dict[str, Any], kills: int, cap: float) -> list[float | None]:
    import json

    results: list[float | None] = []
    with RedisServer() as store, RedisServer() as broker:
        logs = Path(tempfile.mkdtemp(prefix="bench-beat-"))
        observer_url = broker.url.replace("/0", "/2")
        env = app_env(store.url, broker.url, broker.url.replace("/0", "/1"), observer_url)
        env.update(beat_env({"every1": {"every": 1}}))
        env["BEAT_CONF"] = json.dumps(conf)
        worker: WorkerProcess = start_worker(APP, env=env, concurrency=2, log_dir=logs)
        worker.wait_ready()
        beats = [start_beat(APP, env=env, scheduler=scheduler, log_dir=logs) for _ in range(3)]
        observer = Observer(observer_url)
        try:
            for beat in beats:
                beat.wait_started()
            for _ in range(kills):
                leader = None
                deadline = time.monotonic() + cap
                while leader is None and time.monotonic() < deadline:
                    leader = current_leader(beats)
                if leader is None:
                    results.append(None)
                    break
                seen = len(observer.started())
                killed_at = server_us(broker)
                leader.kill()
                beats.append(start_beat(APP, env=env, scheduler=scheduler, log_dir=logs))
                first: int | None = None
                deadline = time.monotonic() + cap
                while first is None and time.monotonic() < deadline:
                    after = [
                        s["start"] for s in observer.started()[seen:] if s["start"] > killed_at
                    ]
                    first = min(after) if after else None
                    time.sleep(0.05)
                results.append(None if first is None else (first - killed_at) / 1e6)
                if first is None:
                    break
        finally:
            for beat in beats:
                beat.stop(timeout=5)
            worker.stop(timeout=5)
            observer.close()
    return results


def main() -> None:
    args = parse_args(
        __doc__ or "",
        kills=dict(type=int, default=3, help="leader kills per scheduler"),
        cap=dict(type=float, default=90.0, help="give up waiting after this many seconds"),
    )
    kills = 1 if args.quick else args.kills
    rows = []
    for label, (scheduler, conf) in SCHEDULERS.items():
        times = measure(scheduler, conf, kills, args.cap)
        done = [t for t in times if t is not None]
        shown = ", ".join("> cap" if t is None else f"{t:.1f}" for t in times)
        median = f"{statistics.median(done):.1f}" if done else f"> {args.cap:.0f}"
        rows.append((label, shown, median))
        print(f"{label}: {shown}", flush=True)
    print()
    print(table(["scheduler", "failover after SIGKILL, each kill (s)", "median (s)"], rows))
    print()
    print(f"Machine: {machine_note()}")


if __name__ == "__main__":
    main()
