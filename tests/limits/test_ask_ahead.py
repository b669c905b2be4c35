"""A request asked before its pool slot frees (worker/asking_ahead.py, issue 36): its
grant is used only within ``AHEAD_BOUND`` of the store's answer, and given back past it.

Judged from outside, on one clock: an exclusive run's ``fence()`` on a key used once
(a rated task's too: tests/apps/limits.py) is the store's ``TIME`` when it granted the
lease (gate/lease.lua: a new key's first token is the grant's instant), and the
observer stamps the body's first line with its own server's ``TIME``; both servers run
on this machine.
"""

from __future__ import annotations

import time

import pytest

from celery_baton.core.keys import KeyNames, digest
from celery_baton.worker.asking_ahead import AHEAD_BOUND
from tests.support.observer import Observer
from tests.support.servers import StoreServer
from tests.support.waiting import wait_until
from tests.support.workers import Workers

APP = "tests.apps.exclusive"

#: The hand-over to a pool process on a loaded 2-core machine (IPC, a process switch):
#: measured up to ~60 ms (tests/limits/test_at_start.py); an order of magnitude above
#: the bound, which alone would be 20 ms.
HAND_OVER_US = 250_000


@pytest.mark.parametrize("kind", ["exclusive", "rate"])
def test_no_grant_is_older_than_the_bound_at_the_bodys_start(
    workers: Workers, observer: Observer, kind: str
) -> None:
    """A drain of short exclusive tasks, or of a global rate's (1000/s, its token spent
    at the grant), on one worker (prefork, concurrency 2, Celery's default prefetch):
    the pool drains short tasks, so the next request is asked ahead."""
    from tests.apps.exclusive import ex_skip
    from tests.apps.limits import rated_drain

    n = 300
    if kind == "exclusive":
        workers.start(APP, concurrency=2)
        for i in range(n):
            ex_skip.delay(f"ahead-{i}", 0.002)
    else:
        workers.start("tests.apps.limits", concurrency=2)
        for i in range(n):
            rated_drain.delay(i, 0.002)
    runs = observer.wait_for(n, timeout=180)
    ages = sorted(run.start - (run.fence or 0) for run in runs)
    assert all(run.fence for run in runs)
    assert ages[0] > -HAND_OVER_US, ages[:5]  # one clock: no start before its grant
    assert ages[-1] <= AHEAD_BOUND * 1_000_000 + HAND_OVER_US, (
        f"a run started {ages[-1] / 1000:.0f} ms after the store granted its lease "
        f"(bound {AHEAD_BOUND * 1000:.0f} ms + hand-over); the oldest five: {ages[-5:]}"
    )


def test_a_grant_asked_ahead_that_finds_no_slot_is_given_back(
    workers: Workers, observer: Observer, store_server: StoreServer
) -> None:
    """Two processes: short runs (the pool drains), then two that run 3 s each. The
    request behind them is asked ahead as the second long one starts; no process frees
    within the bound, so its lease is given back: the key is free while they run."""
    from tests.apps.exclusive import ex_skip

    workers.start(APP, concurrency=2)
    for i in range(40):
        ex_skip.delay(f"short-{i}", 0.0)
    ex_skip.delay("long-a", 3.0)
    ex_skip.delay("long-b", 3.0)
    ex_skip.delay("behind", 0.0)
    wait_until(
        lambda: {"long-a", "long-b"} <= {s["key"] for s in observer.started()},
        60,
        "both long runs started",
    )
    key = KeyNames().lease("tests.apps.exclusive.ex_skip", "ex", digest('{"key":"behind"}'))
    time.sleep(0.5)  # 25 bounds: a grant asked ahead is given back by now
    with store_server.client() as client:
        holders = [f for f in client.hkeys(key) if f.startswith("o:")]
    assert not any(r.key.startswith("long") for r in observer.runs()), "a long run ended early"
    assert not holders, f"{key} held by {holders} while its request waits for a process"
    observer.wait_for(43, timeout=60)  # and it runs once a process frees
