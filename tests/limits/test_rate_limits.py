"""Global rate limits across real workers (issue 3), judged from outside the library.

The property under test is the GCRA bound: in ANY window of length ``w`` at most
``burst + w * rate`` admissions, and a backlog achieves the rate within a few percent.

Two clocks, both servers' ``TIME``, never a worker's:

* the admission instant: each rate-limited task of ``tests.apps.limits`` also takes an
  always-free exclusive lease, whose fencing token is the store server's ``TIME`` in
  the gate call that admitted it (see that module). The bound is checked on these,
  exactly: a start admitted one microsecond early fails.
* the start as the task saw it, stamped by the observer server: used for the achieved
  rate over the whole backlog (seconds long, so the few-ms delay between admission and
  the task's first line does not matter). On a loaded 2-core machine that delay was
  measured at up to ~60 ms for single starts, too much to judge a 50 ms interval by.

Rate tests run the ``solo`` pool (the task runs in the consumer's process right after
admission); admission is in the consumer either way, so the pool does not change what
is tested.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import pytest

from tests.support.celery_processes import WorkerProcess
from tests.support.observer import Observer, Run
from tests.support.stalls import Stall, StallWatch
from tests.support.workers import Workers

APP = "tests.apps.limits"

#: Admission instants are read from one server clock: no tolerance but rounding.
CLOCK_TOLERANCE_US = 1

#: The achieved rate of a backlog must be within this fraction of the limit: above it
#: (the guarantee: never excused) ...
RATE_TOLERANCE = 0.05
#: ... and below it, where a loaded machine costs throughput the stall watch does not see
#: (a busy machine is slow, not stopped: 18.8/s at 20/s with the cores twice over
#: busy). Still far above the next lower limit a test sets (half), so a limit that did not
#: follow its change is caught.
SLOW_TOLERANCE = 0.25


# -- checkers (also used by the concurrency tests) -------------------------------------


def gcra_excess_us(starts: Iterable[int], per_second: float, burst: int) -> tuple[float, str]:
    """By how many microseconds the worst window breaks ``burst + w * rate``.

    For every pair of starts ``i < j`` (sorted), the ``j - i + 1`` starts lie in a window
    of length ``s[j] - s[i]``; GCRA admits at most ``burst + (s[j] - s[i]) * rate`` there,
    i.e. it needs ``s[j] - s[i] >= (j - i + 1 - burst) * interval``. Returns the largest
    shortfall (<= 0: the bound holds everywhere) and a description of that window.
    """
    s = sorted(starts)
    interval = 1_000_000 / per_second
    worst, where = float("-inf"), "no window"
    for i in range(len(s)):
        for j in range(i + burst, len(s)):
            shortfall = (j - i + 1 - burst) * interval - (s[j] - s[i])
            if shortfall > worst:
                worst = shortfall
                where = (
                    f"{j - i + 1} starts in {(s[j] - s[i]) / 1000:.1f} ms "
                    f"(allowed {burst} + {(s[j] - s[i]) / interval:.2f})"
                )
    return worst, where


def assert_gcra_bound(
    starts: Sequence[int],
    per_second: float,
    burst: int = 1,
    tolerance_us: float = CLOCK_TOLERANCE_US,
) -> None:
    """Assert no window holds more than ``burst + w * rate`` starts (within tolerance)."""
    excess, where = gcra_excess_us(starts, per_second, burst)
    assert excess <= tolerance_us, (
        f"rate {per_second}/s burst {burst} exceeded: {where}; the window is "
        f"{excess / 1000:.3f} ms too short; "
        f"most starts in any 1 s window: {max_in_window(starts, 1_000_000)}"
    )


def achieved_rate(starts: Sequence[int], burst: int = 1, stalled_us: int = 0) -> float:
    """Starts per second of a backlog: the first ``burst`` start at once, the rest paced;
    ``stalled_us``: time in which the machine ran nothing, left out of the span."""
    s = sorted(starts)
    return (len(s) - burst) / ((s[-1] - s[0] - stalled_us) / 1_000_000)


def assert_rate_near(
    starts: Sequence[int], per_second: float, burst: int = 1, stalls: StallWatch | None = None
) -> None:
    """The backlog ran at ``per_second``: at most RATE_TOLERANCE above, at most
    SLOW_TOLERANCE below.

    Too fast is never excused. Too slow is judged again without the time in which the
    whole machine stood still (``stalls``), when there was any: every worker lost those
    slots together, and strict GCRA gives no credit for them afterwards.
    """
    rate = achieved_rate(starts, burst)
    low = (1 - SLOW_TOLERANCE) * per_second
    stalled = stalls.stalled_us(min(starts), max(starts)) if stalls and rate < low else 0
    judged = achieved_rate(starts, burst, stalled)
    assert low <= judged <= (1 + RATE_TOLERANCE) * per_second, (
        f"achieved {rate:.2f}/s over {len(starts)} starts ({judged:.2f}/s leaving out "
        f"{stalled / 1000:.0f} ms in which the machine stood still); the limit is "
        f"{per_second}/s (-{SLOW_TOLERANCE:.0%} / +{RATE_TOLERANCE:.0%})"
    )


def max_in_window(starts: Iterable[int], window_us: int) -> int:
    """The most starts in any half-open window ``[t, t + window_us)``."""
    s = sorted(starts)
    most, first = 0, 0
    for last in range(len(s)):
        while s[last] - s[first] >= window_us:
            first += 1
        most = max(most, last - first + 1)
    return most


def start_workers(workers: Workers, n: int, **kw: Any) -> list[WorkerProcess]:
    """Start ``n`` workers of the limits app in parallel and wait until all are ready.

    Default: the solo pool (see the module docstring); pass ``pool=`` to change it.
    """
    kw.setdefault("pool", "solo")
    kw.setdefault("concurrency", 1)
    started = [workers.start(APP, wait=False, **kw) for _ in range(n)]
    for worker in started:
        worker.wait_ready()
    return started


def runs_per_worker(runs: Iterable[Run], started: Sequence[WorkerProcess]) -> Counter[str]:
    """How many runs each worker's pool ran (by the pid stamped on each run)."""
    owner = {pid: w.name for w in started for pid in [w.pid, *w.pool_pids()]}
    return Counter(owner.get(run.pid, f"pid {run.pid}") for run in runs)


_numbers = itertools.count()


def publish(task: Any, n: int, *args: Any, numbered: bool = False) -> None:
    """Publish ``n`` calls of ``task`` on one producer connection; ``numbered``: each
    call also gets a distinct ``n`` keyword (the rate tasks' exclusive key)."""
    with task.app.producer_or_acquire() as producer:
        for _ in range(n):
            kwargs = {"n": next(_numbers)} if numbered else {}
            task.apply_async(args, kwargs, producer=producer)


def admissions(runs: Iterable[Run]) -> list[int]:
    """The admission instants (store server TIME, us) the runs carry as their fence."""
    fences = [r.fence for r in runs]
    assert all(isinstance(f, int) and f > 0 for f in fences), fences[:5]
    return [int(f) for f in fences if f is not None]


def server_time_us(observer: Observer) -> int:
    """Now, by the observer server's clock (the clock every run is stamped with)."""
    seconds, micros = observer._redis.time()
    return int(seconds) * 1_000_000 + int(micros)


# -- the checkers themselves ---------------------------------------------------------


def test_gcra_checker_on_hand_made_starts() -> None:
    paced = [i * 50_000 for i in range(10)]  # exactly 20/s
    assert gcra_excess_us(paced, 20, 1)[0] <= 0
    assert achieved_rate(paced) == pytest.approx(20)
    # Two starts 30 ms apart break 20/s burst 1 by 20 ms, and fit a burst of 2.
    assert gcra_excess_us([0, 30_000], 20, 1)[0] == pytest.approx(20_000)
    assert gcra_excess_us([0, 30_000], 20, 2)[0] <= 0
    # A window in the middle: 3 starts within 60 ms at 20/s need 100 ms.
    starts = [0, 200_000, 230_000, 260_000, 600_000]
    excess, where = gcra_excess_us(starts, 20, 1)
    assert excess == pytest.approx(40_000)
    assert where.startswith("3 starts in 60.0 ms")
    assert max_in_window(starts, 100_000) == 3
    with pytest.raises(AssertionError, match="exceeded"):
        assert_gcra_bound(starts, 20)


def test_rate_checker_leaves_out_only_time_the_machine_stood_still() -> None:
    """A 1.5 s hole in a 20/s backlog fails the rate check, unless the whole machine was
    seen standing still then; a backlog too fast is never excused."""
    paced = [i * 50_000 for i in range(60)]
    holed = paced[:30] + [t + 1_500_000 for t in paced[30:]]
    with pytest.raises(AssertionError, match="achieved 13"):
        assert_rate_near(holed, 20)
    watch = StallWatch()
    with pytest.raises(AssertionError, match="leaving out 0 ms"):
        assert_rate_near(holed, 20, stalls=watch)  # no stall seen: no excuse
    watch.stalls.append(Stall(paced[29] + 10_000, 1_500_000))
    assert_rate_near(holed, 20, stalls=watch)
    with pytest.raises(AssertionError, match="achieved 25"):
        assert_rate_near([i * 40_000 for i in range(60)], 20, stalls=watch)


def test_stall_watch_sees_the_process_stopped() -> None:
    """The detector itself: this process is stopped (SIGSTOP) for 0.4 s from outside."""
    import os
    import subprocess

    with StallWatch() as watch:
        time.sleep(0.05)
        subprocess.run(
            ["sh", "-c", f"kill -STOP {os.getpid()}; sleep 0.4; kill -CONT {os.getpid()}"]
        )
        time.sleep(0.05)
    assert len(watch.stalls) == 1, watch.stalls
    assert 300_000 <= watch.stalls[0].length_us < 5_000_000
    start = watch.stalls[0].start_us
    assert watch.stalled_us(start - 1_000_000, start + 100_000) >= 90_000


# -- real workers --------------------------------------------------------------------


@pytest.fixture
def stalls() -> Iterator[StallWatch]:
    with StallWatch() as watch:
        yield watch


def test_global_rate_limit_holds_across_three_workers(
    workers: Workers, observer: Observer, stalls: StallWatch
) -> None:
    from tests.apps import limits

    started = start_workers(workers, 3)
    publish(limits.rated, 120, numbered=True)

    runs = observer.wait_for(120, timeout=60)

    assert len(runs) == len(observer.started()) == 120
    assert_gcra_bound(admissions(runs), 20)
    assert_rate_near([r.start for r in runs], 20, stalls=stalls)
    # Not one worker doing it all: the limit is shared by several admitting workers.
    per_worker = runs_per_worker(runs, started)
    assert len(per_worker) >= 2, per_worker


def test_per_key_rate_limits_run_in_parallel(
    workers: Workers, observer: Observer, stalls: StallWatch
) -> None:
    from tests.apps import limits

    started = start_workers(workers, 3)
    tenants = ("red", "green", "blue")
    with limits.app.producer_or_acquire() as producer:
        for i in range(30):
            for j, tenant in enumerate(tenants):
                limits.rated_by_tenant.apply_async((tenant, 3 * i + j), producer=producer)

    runs = observer.wait_for(90, timeout=60)

    for tenant in tenants:
        mine = [r for r in runs if r.key == tenant]
        assert len(mine) == 30, tenant
        assert_gcra_bound(admissions(mine), 10)
        assert_rate_near([r.start for r in mine], 10, stalls=stalls)
    # Each key has its own budget: the three ran side by side, not one after another
    # (together 30/s; one shared 10/s limit would need 9 s).
    together = achieved_rate([r.start for r in runs])
    assert together > 2 * 10, f"{together:.1f}/s for the three keys together"
    assert len(runs_per_worker(runs, started)) >= 2


def test_burst_starts_back_to_back_then_paced(
    workers: Workers, observer: Observer, stalls: StallWatch
) -> None:
    from tests.apps import limits

    start_workers(workers, 2)
    publish(limits.bursty, 25, numbered=True)

    runs = observer.wait_for(25, timeout=60)

    admitted = sorted(admissions(runs))
    assert_gcra_bound(admitted, 10, burst=5)
    assert_rate_near([r.start for r in runs], 10, burst=5, stalls=stalls)
    # The burst was used: burst 1 would have put one interval (100 ms) between each two
    # of the first 5 admissions, 400 ms from the first to the fifth; sooner than that is
    # the burst (back to back on a quiet machine; the workers' own pace on a loaded one).
    assert admitted[4] - admitted[0] < 4 * 100_000, [a - admitted[0] for a in admitted[:6]]


def test_celery_rate_limit_becomes_global_and_follows_control(
    workers: Workers, observer: Observer, stalls: StallWatch
) -> None:
    """``baton_global_rate_limits``: Celery's ``rate_limit="10/s"`` over 2 workers is
    10/s in total (Celery alone gives 10/s per worker), and ``app.control.rate_limit``
    reaches every worker."""
    from tests.apps import limits

    started = start_workers(workers, 2)
    publish(limits.celery_rated, 40, numbered=True)
    before = observer.wait_for(40, timeout=60)
    assert_gcra_bound(admissions(before), 10)
    assert_rate_near([r.start for r in before], 10, stalls=stalls)
    assert len(runs_per_worker(before, started)) == 2

    replies = limits.app.control.rate_limit(limits.celery_rated.name, "20/s", reply=True, timeout=5)
    assert len(replies) == 2, replies
    assert all("ok" in next(iter(reply.values())) for reply in replies), replies

    changed_at = server_time_us(observer)
    publish(limits.celery_rated, 60, numbered=True)
    runs = observer.wait_for(100, timeout=60)
    after = [r for r in runs if r.start > changed_at]
    assert len(after) == 60
    assert_gcra_bound(admissions(after), 20)
    assert_rate_near([r.start for r in after], 20, stalls=stalls)


def test_throttled_backlog_does_not_block_other_tasks(workers: Workers, observer: Observer) -> None:
    """1000 messages of a 1/m task wait in the consumer; 50 unlimited tasks published
    after them still run, and the throttled ones run no faster than 1/m."""
    from tests.apps import limits

    worker = workers.start(APP, concurrency=2, prefetch_multiplier=1)
    began = time.monotonic()
    publish(limits.crawl, 1000)
    publish(limits.free, 50)

    runs = observer.runs_of("free", 50, timeout=90)
    elapsed = time.monotonic() - began

    assert len(runs) == 50
    crawled = [e for e in observer.started() if e["key"] == "crawl"]
    assert 1 <= len(crawled) <= 1 + int(elapsed // 60), (len(crawled), elapsed)
    # Stamped by the observer, up to a second after admission: nothing near 60 s.
    assert_gcra_bound([e["start"] for e in crawled], 1 / 60, tolerance_us=1_000_000)
    assert worker.is_running
    # The backlog was held by the consumer, not run or dropped.
    assert "held for" in worker.log_text()


def test_two_limits_on_one_task_are_decided_together(workers: Workers, observer: Observer) -> None:
    """``global_rate_limit=["20/s", "30/m"]`` (issue 15 §3): both limits in the same atomic
    call, so the slower one binds across workers: starts 2 s apart, not 50 ms."""
    from tests.apps import limits

    start_workers(workers, 2)
    publish(limits.two_limits, 3, numbered=True)
    runs = observer.wait_for(3, timeout=60)
    admitted = sorted(admissions(runs))
    gaps = [(b - a) / 1e6 for a, b in itertools.pairwise(admitted)]
    assert all(gap >= 1.9 for gap in gaps), gaps  # 30/m: one per 2 s (GCRA, burst 1)
    assert all(gap < 20 for gap in gaps), gaps  # and not stuck
