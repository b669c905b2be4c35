"""What every bench app shares: URLs from the environment, the readiness mark, and a
per-process client of the broker's redis-server for the tasks' records.

Environment: ``BENCH_BROKER_URL`` (required), ``BENCH_STORE_URL`` (celery-baton's
store), ``BENCH_BATON=0`` (a plain Celery app, without celery-baton),
``BENCH_GUARD=1`` (``baton_redelivery_guard = True``).
"""

from __future__ import annotations

import os
import time

import redis
from celery import Celery, signals

from celery_baton import Baton

_client: redis.Redis | None = None
_client_pid = 0


def make_app(name: str) -> Celery:
    app = Celery(name, broker=os.environ["BENCH_BROKER_URL"])
    app.conf.update(
        task_ignore_result=True,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=True,
    )
    if os.environ.get("BENCH_BATON", "1") == "1":
        app.conf.baton_url = os.environ["BENCH_STORE_URL"]
        app.conf.baton_redelivery_guard = os.environ.get("BENCH_GUARD") == "1"
        Baton(app)
    return app


def bench_redis() -> redis.Redis:
    """A client of the broker's server, one per process (pool children fork)."""
    global _client, _client_pid
    if _client is None or _client_pid != os.getpid():
        _client = redis.Redis.from_url(os.environ["BENCH_BROKER_URL"], decode_responses=True)
        _client_pid = os.getpid()
    return _client


#: Set by a hand-off benchmark while it publishes: a run that starts meanwhile holds its
#: key until the publish ended, so that the hand-offs timed after it do not share the
#: machine's two CPUs with the benchmark's own publisher (which would time the publisher).
PUBLISHING = "bench:publishing"


def hold_while_publishing() -> None:
    client = bench_redis()
    deadline = time.monotonic() + 120
    while client.exists(PUBLISHING) and time.monotonic() < deadline:
        time.sleep(0.001)


def record_done(started: float) -> None:
    """Count a finished task; keep the first start and the last end (local clock)."""
    pipe = bench_redis().pipeline(transaction=False)
    pipe.set("bench:first", repr(started), nx=True)
    pipe.set("bench:last", repr(time.time()))
    pipe.incr("bench:count")
    pipe.execute()


@signals.worker_ready.connect
def _mark_ready(sender: object = None, **kwargs: object) -> None:
    hostname = getattr(sender, "hostname", None)
    if hostname:
        bench_redis().set(f"bench:ready:{hostname}", 1)


if os.environ.get("BENCH_CPROFILE"):  # bench/worker_profile.py --cprofile FILE
    import cProfile
    import threading

    _profile = cProfile.Profile()

    @signals.worker_ready.connect(weak=False)
    def _profile_start(**kwargs: object) -> None:
        # The consumer's loop thread, from readiness on (the drain, not the start-up).
        if threading.current_thread() is threading.main_thread():
            _profile.enable()

    @signals.worker_shutting_down.connect(weak=False)
    def _profile_stop(**kwargs: object) -> None:
        _profile.disable()
        _profile.dump_stats(os.environ["BENCH_CPROFILE"])
