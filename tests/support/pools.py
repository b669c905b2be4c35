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

#: The pools that stop a run at its hard time limit (Celery kills the run's process, or
#: unwinds its greenlet): prefork as Celery runs it by default, prefork recycled after
#: every task (``--max-tasks-per-child 1``: the killed process's replacement and every
#: other process forked later, from the main process; each leaving after one run), prefork
#: grown and shrunk by ``--autoscale 3,1`` (idle processes go after 0.5 s, see
#: :func:`pool_setting`: the pool shrinks and grows around the kill), and gevent.
AUTOSCALED = pytest.param("prefork --autoscale 3,1", id="prefork-autoscale")
TIME_LIMIT_POOLS = [
    "prefork",
    pytest.param("prefork --max-tasks-per-child 1", id="prefork-recycled"),
    AUTOSCALED,
    "gevent",
]


def pool_setting(pool: str) -> tuple[str, list[str], dict[str, str]]:
    """One of the parameters above as ``(pool, extra_args, env)`` for ``workers.start``.
    ``--autoscale`` comes with Celery's ``AUTOSCALE_KEEPALIVE`` of 0.5 s (30 s by
    default): idle processes are terminated within a test, not after it."""
    name, *extra = pool.split()
    autoscaled = any(arg.startswith("--autoscale") for arg in extra)
    return name, extra, ({"AUTOSCALE_KEEPALIVE": "0.5"} if autoscaled else {})


def pool_label(pool: str) -> str:
    """One of the parameters above as one word, for a key (``prefork---autoscale-3,1``)."""
    return "-".join(pool.split())
