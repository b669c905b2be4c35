"""A throttle's window is judged where its run starts: in the pool process.

Issue 34 (d). The main process admits a throttled delivery and the store opens its
window then (throttle_decide.lua). What happens after the hand-over it cannot see: the
pool process may start the body late (stopped, swapped out; the main process stopped
between the hand-over and its write to the child's pipe). The window then ran out
before, or soon after, the run started, and the next window's run (another worker)
started with it. The pool process judges it as it takes the job (before accepting it):
a run that starts late moves its window's start to its real start, and one whose window
another run took meanwhile waits for that window to end and opens the next.

Real workers; starts are stamped by the observer (its own server's clock) at the task
body's first line. Worker A's only pool process is stopped (SIGSTOP) while its run is
handed to it; worker B is idle. Each consumes a queue of its own.
"""

from __future__ import annotations

import itertools
import os
import signal
import time

import pytest

from tests.support.observer import Observer
from tests.support.workers import Workers

#: Admission to the body's first line on a loaded 2-core machine (as in test_at_start).
START_JITTER_US = 250_000


@pytest.mark.parametrize(
    ("stopped", "b_after"),
    [
        # A starts 1.5 s into its 2 s window; B's delivery comes after the window
        # opened at admission ended, but within a window counted from A's start.
        (1.5, 2.5),
        # B's delivery comes while A has not started yet, after A's window ran out:
        # B runs; A starts 0.5 s after it.
        (3.0, 2.5),
    ],
    ids=["late-within-window", "late-past-window"],
)
def test_a_throttled_run_started_late_by_its_pool_process_keeps_its_window(
    workers: Workers, observer: Observer, stopped: float, b_after: float
) -> None:
    """``throttle=2.0`` (drop). A's run is handed to A's stopped process and starts
    ``stopped`` s later; B gets a delivery of the same key ``b_after`` s after A's
    publish. Every two starts are a window apart."""
    from tests.apps import recycled

    a = workers.start("tests.apps.recycled", concurrency=1, queues="a")
    workers.start("tests.apps.recycled", concurrency=1, queues="b")
    (child,) = a.pool_pids()
    os.kill(child, signal.SIGSTOP)
    try:
        published = time.monotonic()
        recycled.throttled.apply_async((0,), queue="a")
        for at, action in sorted(
            [
                (stopped, lambda: os.kill(child, signal.SIGCONT)),
                (b_after, lambda: recycled.throttled.apply_async((1,), queue="b")),
            ],
            key=lambda pair: pair[0],
        ):
            time.sleep(max(0.0, published + at - time.monotonic()))
            action()
    finally:
        os.kill(child, signal.SIGCONT)
    # A run that waits for B's window starts when it ends (2 s after B's start).
    time.sleep(recycled.THROTTLE + 2.0)
    starts = sorted(s["start"] for s in observer.started() if s["key"] == "throttled")
    assert starts, "no throttled run started"
    window_us = recycled.THROTTLE * 1_000_000
    close = [
        round((after - before) / 1e6, 2)
        for before, after in itertools.pairwise(starts)
        if after - before < window_us - START_JITTER_US
    ]
    assert not close, (
        f"two starts of one throttle key closer than its {recycled.THROTTLE:g} s window: "
        f"{close} s apart"
    )
    assert "after its throttle window opened" in a.log_text()  # judged at its start
