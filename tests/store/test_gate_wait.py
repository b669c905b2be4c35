"""Gate.wait_for_grant against a real server: the one "ask until granted" that the pool
process's fresh rate token (worker/pool/rate_grant.py) and a named limit in code
(NamedLimit.acquire) both use: its deadline, reserved slots, store errors, and a refusal
that waiting cannot help."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import pytest
import redis

from celery_baton.core.conditions import NotDone, Rate
from celery_baton.core.gate import NEVER_RETRY, Gate
from celery_baton.errors import StoreUnavailable
from celery_baton.store.connection import connect
from tests.support.servers import StoreServer

RATE = "baton:{t}:rate:wait"
DONE = "baton:{t}:done:wait-1"


@pytest.fixture
def gate(store_url: str) -> Iterator[Gate]:
    store = connect(store_url, socket_timeout=1)
    yield Gate(store)
    store.client.close()


def server_us(gate: Gate) -> int:
    seconds, micros = gate.store.client.time()
    return int(seconds) * 1_000_000 + int(micros)


def test_a_wait_sleeps_as_the_gate_says_then_takes_the_slot(gate: Gate) -> None:
    rate = Rate(RATE, 400_000, 1)
    assert gate.decide([rate], owner="a").granted
    before = server_us(gate)
    assert gate.wait_for_grant([rate], owner="b").granted
    # The next slot is one interval after the first, on the store's clock.
    assert 400_000 - 50_000 <= server_us(gate) - before <= 4_000_000
    assert not gate.decide([rate], owner="c").granted  # and it was taken


def test_a_reserved_slot_is_slept_before_the_grant_is_returned(gate: Gate) -> None:
    rate = Rate(RATE, 400_000, 1)
    assert gate.decide([rate], owner="a").granted
    before = server_us(gate)
    decision = gate.wait_for_grant([rate], owner="b", reserve=1.0)
    assert decision.granted and decision.start_after > 0.3  # reserved in the first ask
    assert server_us(gate) - before >= 350_000  # and its instant had come on return


def test_a_wait_past_the_deadline_returns_the_refusal(gate: Gate) -> None:
    rate = Rate(RATE, 10_000_000, 1)
    assert gate.decide([rate], owner="a").granted
    began = time.monotonic()
    decision = gate.wait_for_grant([rate], owner="b", reserve=1.0, deadline=time.monotonic() + 0.2)
    assert not decision.granted and decision.retry_after > 9  # not reserved past it
    assert time.monotonic() - began < 5  # returned, not slept


def test_a_refusal_waiting_cannot_help_is_returned_under_a_deadline_and_asked_again_without(
    gate: Gate, r: redis.Redis
) -> None:
    r.set(DONE, "")  # the task id's run finished: a copy of it is refused, for good
    condition = NotDone(DONE)
    refused = gate.wait_for_grant([condition], owner="a", deadline=time.monotonic() + 30)
    assert not refused.granted and refused.retry_after < 0  # at once, not in 30 s

    granted: list[bool] = []
    waiter = threading.Thread(
        target=lambda: granted.append(gate.wait_for_grant([condition], owner="a").granted)
    )
    waiter.start()
    time.sleep(NEVER_RETRY * 2)
    assert not granted  # still asking, every NEVER_RETRY, not in a tight loop
    r.delete(DONE)  # from outside the gate (an operator): now it may pass
    waiter.join(NEVER_RETRY * 20)
    assert granted == [True]


def test_store_errors_are_raised_or_waited_out(
    gate: Gate, store_server: StoreServer, caplog: pytest.LogCaptureFixture
) -> None:
    rate = Rate(RATE, 1_000, 1)
    store_server.stop()
    try:
        with pytest.raises(StoreUnavailable):
            gate.wait_for_grant([rate], owner="a")  # no store_retry: raised at once
        with pytest.raises(StoreUnavailable):  # a retry that would pass the deadline
            gate.wait_for_grant(
                [rate], owner="a", store_retry=0.1, deadline=time.monotonic() + 0.35
            )
        granted: list[bool] = []

        def wait() -> None:
            decision = gate.wait_for_grant([rate], owner="a", store_retry=0.1, subject="a test")
            granted.append(decision.granted)

        with caplog.at_level(logging.WARNING, logger="celery_baton.core.gate"):
            waiter = threading.Thread(target=wait)
            waiter.start()
            time.sleep(0.5)
            assert not granted
            store_server.start()
            waiter.join(30)
        assert granted == [True]
        assert "baton: a test waits for the store" in caplog.text
    finally:
        store_server.start()
