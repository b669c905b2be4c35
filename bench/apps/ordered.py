"""Ordered keys for bench/ordered.py: every run records its body's start and end
(``time.time()``: every worker runs on this machine, one clock), its key, its place in
the key's publish order and its worker. The same body under ``ordered=`` and under
``exclusive_conflict="wait"``, the comparison the issue asks for."""

from __future__ import annotations

import time
from typing import Any

from apps.base import bench_redis, hold_while_publishing, make_app

app = make_app("bench_ordered")
app.conf.update(task_acks_late=True, worker_prefetch_multiplier=4)


def _record(task: Any, key: str, n: int, work_ms: float) -> None:
    started = time.time()
    hold_while_publishing()
    time.sleep(work_ms / 1000)
    ended = time.time()  # the body's last moment: the release follows it
    bench_redis().rpush(
        "bench:runs", f"{started:.6f} {ended:.6f} {key} {n} {task.request.hostname}"
    )


@app.task(name="ordered_one", bind=True, ordered="key")
def ordered_one(self: Any, key: str, n: int, work_ms: float) -> None:
    _record(self, key, n, work_ms)


@app.task(name="waiting_one", bind=True, exclusive="key", exclusive_conflict="wait")
def waiting_one(self: Any, key: str, n: int, work_ms: float) -> None:
    _record(self, key, n, work_ms)
