"""A pool whose size cannot be read as a number never breaks the consumer: the slots
fall back to the worker's concurrency, or to one, and say so once (issue 39 §6: Celery's
own ``test_reconnect_cleanup_is_bounded`` builds a Consumer whose pool's ``limit`` is a
mock, and ``int(limit)`` raised TypeError there, so the Consumer was never built)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from celery_baton.worker.pool_slots import CountedSlots, pool_slots


def _consumer(limit: object, concurrency: object = None) -> SimpleNamespace:
    return SimpleNamespace(
        controller=SimpleNamespace(concurrency=concurrency),
        pool=SimpleNamespace(limit=limit),
        timer=object(),
    )


@pytest.mark.parametrize(
    ("limit", "concurrency", "expected"),
    [(object(), 4, 4), (object(), None, 1), ("x", object(), 1), (3, None, 3)],
)
def test_a_pool_size_that_is_not_a_number_falls_back_and_says_so(
    limit: object, concurrency: object, expected: int, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="celery_baton")
    slots = pool_slots(_consumer(limit, concurrency), print)
    assert isinstance(slots, CountedSlots)
    assert slots.limit == expected
    if expected == 3:
        assert not caplog.records
    else:
        assert "pool size" in caplog.text
