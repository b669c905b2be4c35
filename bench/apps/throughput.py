"""No-op tasks for bench/throughput.py and bench/backlog.py.

``BENCH_TASK_MS`` (milliseconds, default 0): every drained task's body sleeps that long
(the same for every variant: a drain of short real tasks rather than of no-ops).
celery-once's and celery-singleton's tasks (the ``bench`` extra) take their locks on
the store's server (``BENCH_STORE_URL``), as celery-baton does.
"""

from __future__ import annotations

import os
import time

from apps.base import make_app, record_done

app = make_app("bench_throughput")

TASK_S = float(os.environ.get("BENCH_TASK_MS") or 0) / 1000


def body() -> None:
    """What every drained task does: its work (``BENCH_TASK_MS``), then its record."""
    started = time.time()
    if TASK_S:
        time.sleep(TASK_S)
    record_done(started)


@app.task(name="noop")
def noop(i: int) -> None:
    body()


@app.task(name="noop_exclusive", exclusive="i")
def noop_exclusive(i: int) -> None:
    body()


@app.task(name="noop_rate", global_rate_limit="1000000/s")
def noop_rate(i: int) -> None:
    body()


@app.task(name="noop_concurrency", global_concurrency=1000)
def noop_concurrency(i: int) -> None:
    body()


@app.task(name="noop_unique", unique="i")
def noop_unique(i: int) -> None:
    body()


@app.task(name="throttled_baton", global_rate_limit="1/m")
def throttled_baton(i: int) -> None:
    pass


@app.task(name="throttled_celery", rate_limit="1/m")
def throttled_celery(i: int) -> None:
    pass


try:  # the bench extra: the libraries celery-baton is measured beside
    from celery_once import QueueOnce
    from celery_singleton import Singleton
except ImportError:  # pragma: no cover - throughput.py says they were left out
    QueueOnce = Singleton = None

if QueueOnce is not None and Singleton is not None:
    store_url = os.environ.get("BENCH_STORE_URL", "")
    app.conf.ONCE = {
        "backend": "celery_once.backends.Redis",
        "settings": {"url": store_url, "default_timeout": 3600},
    }
    app.conf.singleton_backend_url = store_url

    # Locked when published (apply_async), unlocked when the run ends (in the pool
    # process): what each library does for a task that must not be queued twice.
    @app.task(name="noop_once", base=QueueOnce, once={"graceful": True})
    def noop_once(i: int) -> None:
        body()

    @app.task(name="noop_singleton", base=Singleton)
    def noop_singleton(i: int) -> None:
        body()
