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
