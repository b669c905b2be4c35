"""The consumer's memory of announced releases (issue 11, item 9): bounded, and O(1)
amortised per notice however many keys are released."""

from __future__ import annotations

import time
from types import SimpleNamespace

from celery_baton.worker.holding import Holding
from celery_baton.worker.release_log import ReleaseLog


def test_many_notices_cost_the_same_each() -> None:
    """30 000 distinct keys released within seconds: each notice stays cheap. (Rebuilding
    the whole map on every notice past 4096 keys took over half a minute here.)"""
    holding = Holding(
        SimpleNamespace(hostname="w@test"),
        ask=lambda delivery: None,
        hold_max=10,
        horizon=300.0,
        stats={"held": 0},
    )
    began = time.perf_counter()
    for i in range(30_000):
        holding.wake(f"baton:{{t}}:ex:{i}")
    elapsed = time.perf_counter() - began
    assert elapsed < 3.0, f"30000 notices took {elapsed:.1f} s"


def test_the_log_forgets_old_releases_and_stays_bounded() -> None:
    log = ReleaseLog(memory=10.0, most=1000)
    for i in range(5000):  # one a millisecond: 5 s, within memory, past the cap
        log.note(f"k{i}", now=100.0 + i / 1000)
    assert len(log) == 1000  # the newest thousand
    assert log.at("k4999") == 100.0 + 4.999
    assert log.at("k0") == -1.0

    log.note("k4000", now=106.0)  # noted again: moves to the newest end
    log.note("late", now=115.5)  # everything noted before 105.5 is forgotten
    assert log.at("k3999") == -1.0
    assert log.at("k4000") == 106.0 and log.at("late") == 115.5
    assert len(log) == 2

    log.note("later", now=200.0)
    assert len(log) == 1 and log.at("later") == 200.0
