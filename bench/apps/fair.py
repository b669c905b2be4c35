"""Tasks for bench/fairness.py: one cap of 4 shared by tenants, fair or first come first
served. Each run records ``tenant start end`` (local clock: one machine) in the broker's
server."""

from __future__ import annotations

import time

from apps.base import bench_redis, make_app

app = make_app("bench_fair")
SLEEP = 0.05


def _run(tenant: str) -> None:
    start = time.time()
    time.sleep(SLEEP)
    bench_redis().rpush("bench:runs", f"{tenant} {start!r} {time.time()!r}")


@app.task(name="fair_capped", global_concurrency=4, fair_key="tenant")
def fair_capped(tenant: str) -> None:
    _run(tenant)


@app.task(name="fifo_capped", global_concurrency=4)
def fifo_capped(tenant: str) -> None:
    _run(tenant)
