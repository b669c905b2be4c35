"""The rate checks (:func:`check_rate`):

* ``rate-start`` -- starts (the observer's stamp at the body's first line: where the
  user meets the limit) never exceed ``burst + rate * (window + START_TOLERANCE)`` in
  any window.
* ``rate`` -- admissions (the runs' fences, the store's TIME in microseconds) never
  exceed ``burst + rate * window`` in any window.
"""

from __future__ import annotations

from collections.abc import Sequence

from tests.soak.checks.history import SECOND, History, Report, Run

#: Seconds a rated run's start may trail the instant it was due, for the checker: the
#: hand-over to the pool. When a request's instant comes, the worker's main process writes
#: it to a free pool process's pipe; that process reads it, runs Celery's tracer and
#: celery-baton's start-of-run code (fence, leases), and the body's first line makes a
#: round trip to the observer for the stamp. Each step is milliseconds, but the soak runs
#: about ten processes on two cores beside other tests, and a main process busy with a
#: burst of messages hands a request over late: two runs admitted 1/rate apart may start
#: closer. 250 ms covers such stalls with room, and is still a quarter of a second: at
#: the soak's 4/s it excuses one start more in a window, while the fault it is there to
#: find (requests admitted while no process could start them, starting together when
#: one frees) puts the whole backlog of a pool's queue into a few milliseconds.
START_TOLERANCE = 0.25


def _worst_window(
    times: Sequence[int], rate: float, burst: int, tolerance: float
) -> tuple[float, int, int, int] | None:
    """The window ``[times[i], times[j]]`` (sorted microseconds) holding the most events
    beyond ``burst + rate * (window + tolerance)``: ``(excess, n, i, j)``, or None if
    none does. With ``f(k) = k - rate * times[k]``, the ``j - i + 1`` events of a window
    exceed it by ``f(j) - f(i) + 1 - burst - rate * tolerance``, so one pass keeping the
    lowest ``f(i)`` so far finds the worst window of every ``j``."""
    if not times:
        return None
    per_us = rate / SECOND
    limit = burst + rate * tolerance
    worst: tuple[float, int, int, int] | None = None
    low, low_at = 0.0, 0
    for j, at in enumerate(times):
        f = j - per_us * (at - times[0])
        if f < low or j == 0:
            low, low_at = f, j
        excess = f - low + 1 - limit
        if excess > 1e-9 and (worst is None or excess > worst[0]):
            worst = (excess, j - low_at + 1, low_at, j)
    return worst


def check_rate(history: History, runs: list[Run], report: Report) -> None:
    """GCRA with rate r and burst b lets n runs through a window of length L only if
    ``n <= b + L * r``. Judged where the user meets the limit, at the runs' starts (with
    ``START_TOLERANCE`` for the hand-over to the pool), and at the admissions (the runs'
    fences, the store's TIME in the gate call that admitted each)."""
    rated = sorted((r for r in runs if r.key == "rated"), key=lambda r: r.start)
    rate, burst = history.limits.rate, history.limits.burst
    starts = [r.start for r in rated]
    found = _worst_window(starts, rate, burst, START_TOLERANCE)
    if found is not None:
        excess, n, i, j = found
        members = rated[i : j + 1]
        fences = [r.fence for r in members if r.fence is not None]
        admitted = (
            f"; admitted over {(max(fences) - min(fences)) / SECOND:.3f} s"
            f" ({min(fences)} .. {max(fences)})"
            if fences
            else ""
        )
        pids = sorted({r.pid for r in members})
        report.violations["rate-start"].append(
            f"{n} starts in [{starts[i]}, {starts[j]}] ({(starts[j] - starts[i]) / SECOND:.3f} s)"
            f": more than burst {burst} + {rate:g}/s x (window + {START_TOLERANCE:g} s "
            f"hand-over) (worst excess {excess:.2f}){admitted}; pids {pids}"
        )
    report.counts["rated starts"] = len(starts)
    delays = sorted(r.start - r.fence for r in rated if r.fence is not None)
    if delays:
        # From the admitting gate call (store clock) to the body's first line (observer
        # clock; both servers run on this machine): how long admitted runs waited.
        report.counts["rated admission to start p99 ms"] = delays[len(delays) * 99 // 100] // 1000
        report.counts["rated admission to start max ms"] = delays[-1] // 1000
    admitted_at = sorted(r.fence for r in rated if r.fence is not None)
    tolerance = 1_000  # 1 ms: the store's TIME and the fence's rounding
    found = _worst_window(admitted_at, rate, burst, tolerance / SECOND)
    if found is not None:
        excess, n, i, j = found
        first, last = admitted_at[i], admitted_at[j]
        report.violations["rate"].append(
            f"{n} admissions in [{first}, {last}] ({(last - first) / SECOND:.3f} s): more than "
            f"burst {burst} + {rate:g}/s (worst excess {excess:.2f})"
        )
    report.counts["rated admissions"] = len(admitted_at)
