"""A stale rate grant's fresh token, taken in the pool process (worker/pool/rate_grant.py):
what the main process marks, read back on the other side, and the wait for a fresh
token against the real store (the whole path: tests/limits/test_at_start.py)."""

from __future__ import annotations

import pytest

from celery_baton.core.conditions import Override, Rate, TakeLease, WeightedRate
from celery_baton.core.gate import Gate
from celery_baton.store.connection import connect
from celery_baton.worker.pool.rate_grant import (
    RATE_GRANT_FIELD,
    conditions_of,
    mark,
    wait_for_grant,
)


@pytest.fixture
def gate(store_url: str) -> Gate:
    return Gate(connect(store_url, socket_timeout=5))


def server_us(gate: Gate) -> int:
    seconds, micros = gate.store.client.time()
    return int(seconds) * 1_000_000 + int(micros)


def test_the_mark_carries_the_rate_conditions_and_nothing_else() -> None:
    rate = Rate("baton:{t}:rate", 500_000, 2)
    weighted = WeightedRate("baton:limit:{api}", 250_000, 500_000)
    override = Override("baton:{t}:limits", "rate")
    request_dict: dict[str, object] = {}
    mark(request_dict, [TakeLease("baton:{t}:ex:k"), override, rate, weighted], "o", 12.5)
    _pid, due, owner, rates = request_dict[RATE_GRANT_FIELD]  # type: ignore[misc]
    assert (due, owner) == (12.5, "o")
    assert conditions_of(rates) == [override, rate, weighted]


def test_a_plan_without_a_token_is_not_marked() -> None:
    request_dict: dict[str, object] = {}
    mark(request_dict, [TakeLease("baton:{t}:ex:k"), Override("k", "f")], "o", 1.0)
    assert RATE_GRANT_FIELD not in request_dict


def test_a_fresh_grant_waits_for_the_next_token_on_the_stores_clock(gate: Gate) -> None:
    rate = Rate("baton:{t}:rate:fresh", 400_000, 1)
    # Read before the first grant, so a test process paused between the two calls
    # cannot shorten the wait it measures: that token's instant is >= before.
    before = server_us(gate)
    assert gate.decide([rate], owner="a").granted  # the stale grant's token, spent
    wait_for_grant(gate, [rate], "b")
    waited_us = server_us(gate) - before
    # The next token is one interval after the first: a fresh one is not free before.
    assert 400_000 - 50_000 <= waited_us <= 4_000_000
    assert not gate.decide([rate], owner="c").granted  # and it was taken
