"""The demo's Celery app. Broker, results and store all live on the embedded Valkey.

Each task records its run (key, start, end, in the server's microseconds) in a list
that the demo reads afterwards: the demo checks the guarantees from outside.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from celery import Celery

from celery_baton import Baton, fence

BROKER = os.environ.get("BATON_DEMO_BROKER", "redis://127.0.0.1:6379/14")
OBSERVER = os.environ.get("BATON_DEMO_OBSERVER", "redis://127.0.0.1:6379/13")
RUNS = "demo:runs"

app = Celery("baton_demo", broker=BROKER, backend=os.environ.get("BATON_DEMO_RESULTS"))
app.conf.update(
    worker_prefetch_multiplier=4,
    task_acks_late=True,
    beat_schedule={"tick": {"task": "baton_demo.tick", "schedule": 1.0}},
    beat_scheduler="celery_baton.beat:Scheduler",
    baton_beat_lease_ttl=3.0,
    broker_connection_retry_on_startup=True,
)
baton = Baton(app)  # store: $BATON_URL, else the embedded Valkey (the demo sets BATON_URL)
_observer: Any = None


def _client() -> Any:
    global _observer
    if _observer is None:
        import redis

        _observer = redis.Redis.from_url(OBSERVER)
    return _observer


def _server_us() -> float:
    seconds, micros = _client().time()
    return float(seconds * 1_000_000 + micros)


def _record(kind: str, key: str, start: float, **extra: Any) -> None:
    run = {"kind": kind, "key": key, "start": start, "end": _server_us(), **extra}
    _client().rpush(RUNS, json.dumps(run))


@app.task(name="baton_demo.import_feed", exclusive="feed_url")
def import_feed(feed_url: str) -> int:
    start = _server_us()
    time.sleep(0.3)
    _record("import", feed_url, start, fence=fence())
    return fence()


@app.task(name="baton_demo.build_report", unique="report_id")
def build_report(report_id: int) -> None:
    start = _server_us()
    time.sleep(1.0)
    _record("report", str(report_id), start)


@app.task(name="baton_demo.fetch", global_rate_limit="10/s")
def fetch(n: int) -> None:
    _record("fetch", "api", _server_us())


@app.task(name="baton_demo.render", global_concurrency=3)
def render(n: int) -> None:
    start = _server_us()
    time.sleep(0.2)
    _record("render", "render", start)


@app.task(name="baton_demo.tick", bind=True)
def tick(self: Any) -> None:
    _record("tick", self.request.id, _server_us())


@app.task(name="baton_demo.charge", redelivery_guard=True)
def charge(order: int) -> None:
    _record("charge", str(order), _server_us())
