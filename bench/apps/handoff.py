"""One exclusive key for bench/handoff.py: every run records its body's start and end
(``time.time()``: every worker runs on this machine, one clock) and its worker."""

from __future__ import annotations

import os
import time
from typing import Any

from apps.base import bench_redis, hold_while_publishing, make_app

app = make_app("bench_handoff")
WORK_S = float(os.environ.get("BENCH_WORK_MS") or 2) / 1000


@app.task(name="handoff_one", bind=True, exclusive=True, exclusive_conflict="wait")
def handoff_one(self: Any, i: int) -> None:
    started = time.time()
    hold_while_publishing()
    time.sleep(WORK_S)
    ended = time.time()  # the body's last moment: the release follows it
    bench_redis().rpush("bench:runs", f"{started:.6f} {ended:.6f} {self.request.hostname}")
