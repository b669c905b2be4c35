"""Timestamps of each task's way through a worker, for bench/timeline.py.

Imported by every Python process that has this directory on ``PYTHONPATH`` (Python
imports ``sitecustomize`` at start); it does nothing unless ``TIMELINE_DIR`` is set.
Then each process appends ``<monotonic ns> <event> <task id>`` lines to
``$TIMELINE_DIR/<pid>.tl`` (CLOCK_MONOTONIC is one clock for every process):

* main process: ``recv`` (the consumer received the message), ``exec`` (the request
  handed to the pool), ``ready`` (the pool read its process's READY), ``succ``
  (``Request.on_success``);
* pool process: ``pre`` (the first ``task_prerun`` handler), ``post`` (the first
  ``task_postrun`` handler), ``post2`` (one connected after the worker's own: what
  follows ``post`` is celery-baton's end of the run).

and in every process ``gc<generation>`` (a garbage collection that took more than
0.5 ms; its duration in ms in place of the task id, stamped as it ended).

The hooks wrap Celery's own methods, the same for plain Celery and for celery-baton.
"""

from __future__ import annotations

import os
import time
from typing import Any, TextIO

_DIR = os.environ.get("TIMELINE_DIR")
_files: dict[int, TextIO] = {}


def _mark(event: str, task_id: str | None) -> None:
    pid = os.getpid()
    out = _files.get(pid)
    if out is None:
        out = _files[pid] = open(f"{_DIR}/{pid}.tl", "a", buffering=1)  # noqa: SIM115
    out.write(f"{time.monotonic_ns()} {event} {task_id}\n")


def _install() -> None:
    from celery import signals
    from celery.concurrency import asynpool
    from celery.worker import request, strategy

    signals.task_prerun.connect(lambda task_id=None, **_: _mark("pre", task_id), weak=False)
    signals.task_postrun.connect(lambda task_id=None, **_: _mark("post", task_id), weak=False)
    signals.task_received.connect(lambda request=None, **_: _mark("recv", request.id), weak=False)

    def connect_last(**_: Any) -> None:
        signals.task_postrun.connect(lambda task_id=None, **_: _mark("post2", task_id), weak=False)

    signals.worker_process_init.connect(connect_last, weak=False)

    create = request.create_request_cls

    def create_request_cls(*args: Any, **kwargs: Any) -> Any:
        # Celery builds each task's Request class here, with its own fast paths.
        cls = create(*args, **kwargs)
        execute, on_success = cls.execute_using_pool, cls.on_success

        def execute_using_pool(self: Any, pool: Any, **kw: Any) -> Any:
            _mark("exec", self.id)
            return execute(self, pool, **kw)

        def on_success_marked(self: Any, outcome: Any, **kw: Any) -> Any:
            _mark("succ", self.id)
            return on_success(self, outcome, **kw)

        cls.execute_using_pool = execute_using_pool
        cls.on_success = on_success_marked
        return cls

    request.create_request_cls = create_request_cls
    strategy.create_request_cls = create_request_cls  # imported by name there

    on_job_ready = asynpool.AsynPool.on_job_ready

    def on_job_ready_marked(self: Any, job: Any, i: Any, obj: Any, inqW_fd: Any) -> Any:
        _mark("ready", getattr(self._cache.get(job), "correlation_id", None))
        return on_job_ready(self, job, i, obj, inqW_fd)

    asynpool.AsynPool.on_job_ready = on_job_ready_marked


def _watch_collections() -> None:
    import gc

    started = [0]

    def timed(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[0] = time.monotonic_ns()
            return
        took = (time.monotonic_ns() - started[0]) / 1e6
        if took > 0.5:
            _mark(f"gc{info.get('generation')}", f"{took:.2f}")

    gc.callbacks.append(timed)


if _DIR:
    _install()
    _watch_collections()
