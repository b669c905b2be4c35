"""Batched and plain tasks for bench/batching.py: the same work (1 ms per item) as one
task per item, as celery-batches' ``Batches`` task and as celery-baton's ``batch=True``.

Every item is published as ``send_task(name, kwargs={"doc": i})``. Each body records,
buffered and written by a thread of its process every 50 ms (so that the measurement
costs every variant the same and no round trip of its own): ``start end node docs`` per
run (a plain task is a run of one item). Each worker's consumer records ``doc node`` for
every item it receives (``task_received``): which worker received the items of a batch.

Environment (besides apps/base.py's): ``BENCH_NODE`` (the worker's name, in its
records), ``BENCH_PREFETCH`` (``worker_prefetch_multiplier``; celery-batches' docs ask
for 0, no limit), ``BENCH_RESULTS=1`` (results stored in a Redis result backend, db 1 of
the broker's server, by every variant: Celery writes the plain task's, celery-batches'
body writes each request's with ``mark_as_done`` as its docs show, celery-baton writes
each call's from the list the body returns).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from celery import signals

from apps.base import bench_redis, make_app

app = make_app("bench_batching")
RESULTS = os.environ.get("BENCH_RESULTS") == "1"
if RESULTS:
    app.conf.update(
        result_backend=os.environ["BENCH_BROKER_URL"].rsplit("/", 1)[0] + "/1",
        task_ignore_result=False,
    )
if os.environ.get("BENCH_PREFETCH"):
    app.conf.worker_prefetch_multiplier = int(os.environ["BENCH_PREFETCH"])

ITEM_S = 0.001  # the work per item
FLUSH_EVERY = 0.05  # seconds between two writes of a process's records
NODE = os.environ.get("BENCH_NODE", "?")


class Records:
    """Lines appended in memory, pushed to a list of the broker's server by a daemon
    thread of this process (started at the first line: after the pool's fork)."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.lines: list[str] = []
        self.lock = threading.Lock()
        self.pid = 0

    def add(self, line: str) -> None:
        if self.pid != os.getpid():  # a new process: its own buffer and thread
            self.pid = os.getpid()
            self.lines = []
            self.lock = threading.Lock()
            threading.Thread(target=self._flush_forever, daemon=True).start()
        with self.lock:
            self.lines.append(line)

    def _flush_forever(self) -> None:
        while True:
            time.sleep(FLUSH_EVERY)
            with self.lock:
                lines, self.lines = self.lines, []
            if lines:
                bench_redis().rpush(self.key, *lines)


RUNS = Records("bench:runs")
RECEIVED = Records("bench:received")


def work(docs: list[int]) -> None:
    """The body's work and its record: 1 ms per item (one sleep for the lot)."""
    started = time.time()
    time.sleep(ITEM_S * len(docs))
    ended = time.time()
    RUNS.add(f"{started!r} {ended!r} {NODE} {','.join(map(str, docs))}")


@signals.task_received.connect
def _received(sender: Any = None, request: Any = None, **kwargs: Any) -> None:
    doc = (getattr(request, "kwargs", None) or {}).get("doc")
    if doc is not None:
        RECEIVED.add(f"{doc} {NODE} {time.time()!r}")


@app.task(name="item_plain")
def item_plain(doc: int) -> int:
    """One task per item: the anchor."""
    work([doc])
    return doc


if os.environ.get("BENCH_BATON", "1") == "1":

    @app.task(name="item_baton", batch=True, batch_size=100, batch_wait=1.0)
    def item_baton(calls: list[Any]) -> list[int]:
        """celery-baton: up to 100 calls from every worker, 1 s after the first."""
        docs = [c.kwargs["doc"] for c in calls]
        work(docs)
        return docs


try:  # the bench extra's anchor
    from celery_batches import Batches
except ImportError:  # pragma: no cover - batching.py says it was left out
    Batches = None

if Batches is not None:

    @app.task(name="item_batches", base=Batches, flush_every=100, flush_interval=1)
    def item_batches(requests: list[Any]) -> None:
        """celery-batches: up to 100 requests of this worker, flushed every 1 s."""
        docs = [r.kwargs["doc"] for r in requests]
        work(docs)
        if RESULTS:  # its docs' way: each request's result written by the body
            for request, doc in zip(requests, docs, strict=True):
                app.backend.mark_as_done(request.id, doc, request=request)
