"""The pure parts of worker/outcomes.py: Celery's rate_limit as admission reads it, and
a message's urgency as its broker orders it. (The outcomes themselves, skip, refuse and
hand back, act on a real worker's request: tests/worker.)"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from celery_baton.worker.outcomes import CeleryRates, urgency


@dataclass
class Task:
    rate_limit: Any
    name: str = "t.feed"


@dataclass
class Request:
    delivery_info: dict[str, Any] | None


@pytest.mark.parametrize(
    ("value", "per_second"),
    [("10/s", 10.0), ("6/m", 0.1), ("36/h", 0.01), (5, 5.0), ("0/s", None), (None, None)],
)
def test_a_rate_limit_is_starts_per_second(value: Any, per_second: float | None) -> None:
    assert CeleryRates().of(Task(value)) == (pytest.approx(per_second) if per_second else None)


def test_a_value_celery_cannot_read_limits_nothing_and_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rates = CeleryRates()
    assert rates.of(Task("ten per second")) is None
    assert "is not a rate" in caplog.text
    caplog.clear()
    assert rates.of(Task("ten per second")) is None  # read once: logged once
    assert caplog.text == ""


def test_urgency_follows_the_brokers_order() -> None:
    assert urgency(Request({"priority": 9}), lower_first=False) == 9
    assert urgency(Request({"priority": 9}), lower_first=True) == -9
    assert urgency(Request({}), lower_first=False) is None
    assert urgency(Request(None), lower_first=True) is None
    assert urgency(Request({"priority": "high"}), lower_first=False) is None
