"""Celery's pools as test parameters: every pool a worker can run, eventlet only where
it is installed (its parameter says so when it is skipped)."""

from __future__ import annotations

import importlib.util

import pytest

EVENTLET = pytest.param(
    "eventlet",
    marks=pytest.mark.skipif(
        importlib.util.find_spec("eventlet") is None, reason="eventlet is not installed"
    ),
)

#: Every pool: prefork (Celery's default), threads, gevent, eventlet and solo.
ALL_POOLS = ["prefork", "threads", "gevent", EVENTLET, "solo"]

#: Every pool, prefork with its processes recycled (``--max-tasks-per-child 2``: each
#: forked later, from the main process, after some runs), and prefork grown and shrunk
#: by ``--autoscale`` (its processes forked as the backlog comes, from the main process
#: too): split the parameter into the pool's name and its extra arguments.
POOLS_AND_RECYCLED = [
    *ALL_POOLS,
    pytest.param("prefork --max-tasks-per-child 2", id="prefork-recycled"),
    pytest.param("prefork --autoscale 3,1", id="prefork-autoscale"),
]
