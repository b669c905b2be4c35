"""A request is asked of the gate only when a pool process can start it now, also when
the pool replaces its processes (``--max-tasks-per-child`` or ``--max-memory-per-child``,
the usual cures for leaky tasks).

Issue 34 §1. Celery's pool semaphore was taken for "a process can start it now". It is
released when a process reports its job READY, although a process that ran its
``--max-tasks-per-child`` is leaving, and again when the pool joins that process; the
replacement was forked at the pool's next maintenance tick (5 s). Meanwhile the worker
held what the gate granted for requests no process could start: both slots of a
``global_concurrency=2`` while the other worker's free process ran nothing, and a
throttle window opened seconds before its run started, so that another worker's run of
the next window started with it.

Real workers; starts and ends are stamped by the observer (its own server's clock) at
the task body; each worker consumes a queue of its own, so that what one of them does
while the other holds the slots is plain to see.
"""

from __future__ import annotations

import itertools
import time

import pytest

from tests.support.observer import Observer, Run
from tests.support.workers import Workers

#: Admission to the body's first line on a loaded 2-core machine (as in test_at_start).
START_JITTER_US = 250_000

#: How long the worker whose process is never replaced may stand idle between two of
#: its runs while its queue still holds capped work. Its next run asks the moment its
#: process reports the last one ready: milliseconds, a few hundred on a loaded machine.
#: Held out of the slots by the other worker, it stood idle 3-5 s (the pool's tick).
IDLE_MAX_US = 2_500_000

#: The two ways a process leaves after a run: its count of tasks, or its memory (every
#: process is above 1 kB: it leaves after each run, unannounced, as a leaky task's does).
RECYCLED = pytest.mark.parametrize(
    "recycle",
    [["--max-tasks-per-child=1"], ["--max-memory-per-child=1"]],
    ids=["max-tasks", "max-memory"],
)


def _runs_of_the_kept_process(runs: list[Run], expected: int) -> list[Run]:
    """B's runs: those of the one process that ran most (A's process is a new one for
    every run); B ran all of its ``expected``."""
    by_pid: dict[int, list[Run]] = {}
    for run in runs:
        by_pid.setdefault(run.pid, []).append(run)
    kept = max(by_pid.values(), key=len)
    assert len(kept) == expected, {pid: len(r) for pid, r in by_pid.items()}
    return kept


def _idle_gaps(runs: list[Run]) -> list[int]:
    ordered = sorted(runs, key=lambda r: r.start)
    return [after.start - before.end for before, after in itertools.pairwise(ordered)]


@RECYCLED
def test_a_recycling_worker_holds_no_concurrency_slot_it_cannot_start(
    workers: Workers, observer: Observer, recycle: list[str]
) -> None:
    """``global_concurrency=2``; worker A (``-c 1 --max-tasks-per-child=1``) and worker B
    (``-c 1``) each have 6 capped tasks of 1 s. A holds at most one slot (it has one
    process): B's process runs its tasks back to back."""
    from tests.apps import recycled

    workers.start("tests.apps.recycled", concurrency=1, queues="a", extra_args=recycle)
    workers.start("tests.apps.recycled", concurrency=1, queues="b")
    for _ in range(6):
        recycled.capped.apply_async((1.0,), queue="a")
        recycled.capped.apply_async((1.0,), queue="b")
    gaps = _idle_gaps(_runs_of_the_kept_process(observer.runs_of("capped", 12, timeout=120), 6))
    assert max(gaps) <= IDLE_MAX_US, (
        f"B stood idle {max(gaps) / 1e6:.2f} s between two of its runs (gaps "
        f"{[round(g / 1e6, 2) for g in gaps]} s) while A held the slots for requests "
        "its leaving process could not start"
    )
    assert observer.max_running("capped") <= recycled.CAPPED


#: How long a leaving process of worker A takes to exit in the test below.
SLOW_EXIT = 8


@RECYCLED
def test_a_worker_whose_process_is_leaving_holds_no_slot_while_it_exits(
    workers: Workers, observer: Observer, recycle: list[str]
) -> None:
    """``global_concurrency=1``; worker A (``-c 1``, recycled) takes 8 s to exit each
    leaving process (a slow ``worker_process_shutdown``), worker B (``-c 1``) is
    plain. Each has 4 tasks of 0.3 s. While A's process exits, A has no process that can
    start a run: it must leave the one slot to B, whose runs then follow each other
    closely. (A worker that took its leaving process for free took the slot for a run
    that waited for the replacement: B stood idle for the whole exit.)"""
    from tests.apps import recycled

    workers.start(
        "tests.apps.recycled",
        concurrency=1,
        queues="a",
        extra_args=recycle,
        env={"RECYCLED_SLOW_EXIT": str(SLOW_EXIT)},
    )
    workers.start("tests.apps.recycled", concurrency=1, queues="b")
    for _ in range(4):
        recycled.alone.apply_async((0.3,), queue="a")
        recycled.alone.apply_async((0.3,), queue="b")
    gaps = _idle_gaps(_runs_of_the_kept_process(observer.runs_of("alone", 8, timeout=120), 4))
    assert max(gaps) <= IDLE_MAX_US, (
        f"B stood idle {max(gaps) / 1e6:.2f} s between two of its runs (gaps "
        f"{[round(g / 1e6, 2) for g in gaps]} s) while A held the slot for a run its "
        f"leaving process could not start ({SLOW_EXIT} s to exit)"
    )
    assert observer.max_running("alone") <= 1


@RECYCLED
def test_a_recycling_worker_hands_its_rate_grants_to_a_process_that_starts_them(
    workers: Workers, observer: Observer, recycle: list[str]
) -> None:
    """1/s on one worker ``-c 1 --max-tasks-per-child=1``: a grant goes to the pool when
    its replacement process is up, not to the leaving one, so it is not late there and
    does not spend a second, fresh token (before: most of them did, the rate halved)."""
    from tests.apps import recycled
    from tests.limits.test_rate_limits import assert_gcra_bound

    worker = workers.start("tests.apps.recycled", concurrency=1, extra_args=recycle)
    for n in range(12):
        recycled.rated.delay(n)
    starts = [s["start"] for s in observer.starts_of("rated", 12, timeout=90)]
    assert_gcra_bound(starts, 1.0, burst=1, tolerance_us=START_JITTER_US)
    fresh = worker.log_text().count("after its rate grant")
    assert fresh <= 4, f"{fresh} of 12 grants reached their pool process late"


@RECYCLED
def test_a_throttle_window_opens_when_a_recycled_process_starts_the_run(
    workers: Workers, observer: Observer, recycle: list[str]
) -> None:
    """``throttle=2.0`` (drop). Publishes a window and a bit apart, to A
    (``-c 1 --max-tasks-per-child=1``) twice, then to B: A's second run was admitted,
    its window opened, while A had no process to start it; B's run of the next window
    then started with it. Every two starts are a window apart."""
    from tests.apps import recycled

    workers.start("tests.apps.recycled", concurrency=1, queues="a", extra_args=recycle)
    workers.start("tests.apps.recycled", concurrency=1, queues="b")
    apart = recycled.THROTTLE + 0.3
    for n, queue in enumerate("aab" * 4):
        recycled.throttled.apply_async((n,), queue=queue)
        time.sleep(apart)
    time.sleep(6)  # a run admitted late starts by the pool's next tick at the latest
    starts = sorted(s["start"] for s in observer.started() if s["key"] == "throttled")
    assert len(starts) >= 4, starts
    window_us = recycled.THROTTLE * 1_000_000
    close = [
        round((after - before) / 1e6, 2)
        for before, after in itertools.pairwise(starts)
        if after - before < window_us - START_JITTER_US
    ]
    assert not close, f"two starts of one throttle key closer than its window: {close} s"
