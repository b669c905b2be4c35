"""Polling helpers for tests that wait on real processes."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(
    predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.05
) -> float:
    """Poll ``predicate`` until it is true; return the seconds it took.

    Raises ``AssertionError`` naming ``what`` after ``timeout`` seconds.
    """
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(interval)
    return time.monotonic() - start
