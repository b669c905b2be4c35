"""No-op tasks for bench/throughput.py and bench/backlog.py."""

from __future__ import annotations

import time

from apps.base import make_app, record_done

app = make_app("bench_throughput")


@app.task(name="noop")
def noop(i: int) -> None:
    record_done(time.time())


@app.task(name="noop_exclusive", exclusive="i")
def noop_exclusive(i: int) -> None:
    record_done(time.time())


@app.task(name="noop_rate", global_rate_limit="1000000/s")
def noop_rate(i: int) -> None:
    record_done(time.time())


@app.task(name="noop_unique", unique="i")
def noop_unique(i: int) -> None:
    record_done(time.time())


@app.task(name="throttled_baton", global_rate_limit="1/m")
def throttled_baton(i: int) -> None:
    pass


@app.task(name="throttled_celery", rate_limit="1/m")
def throttled_celery(i: int) -> None:
    pass
