"""The checks of keys that one run holds at a time (each a function named ``check_*``):

* ``exclusive``  -- no two runs of one exclusive key overlap, and fences grow in start
  order. Known window: the earlier run's lease was lost (its worker logged the loss, or
  the store was unreachable for long enough that the lease ran out while it ran).
* ``concurrency`` -- never more than the cap running at one instant (same known window).
* ``unique`` -- no two task ids of one unique key run at once. Known window: one of
  them is a copy of a run whose process died right after its end (before Celery heard
  of it: ``unique-copy-after-end``).
"""

from __future__ import annotations

import itertools

from tests.soak.checks.history import SECOND, WORKER_DEATHS, History, Report
from tests.soak.checks.spans import (
    ACK_RELEASE_WINDOW,
    _by_key,
    _describe,
    _lease_may_be_lost,
    _overlaps,
    _Span,
)


def check_exclusive(history: History, spans: list[_Span], report: Report) -> None:
    for key, group in sorted(_by_key(spans, ("ex_skip:", "ex_wait:")).items()):
        for earlier, later in _overlaps(group):
            what = f"key {key!r}: {_describe(earlier)} overlaps {_describe(later)}"
            if earlier.run.task_id == later.run.task_id:
                report.violations["exclusive"].append(f"{what} (one task id twice at once)")
                continue
            newer_fence = (
                earlier.run.fence is not None
                and later.run.fence is not None
                and later.run.fence > earlier.run.fence
            )
            why = _lease_may_be_lost(history, earlier, later.run.start) if newer_fence else ""
            if why:
                report.known["exclusive-lease-lost"].append(f"{what}: {why}")
            else:
                report.violations["exclusive"].append(what)
        fenced = [s for s in group if s.run.fence is not None]
        for before, after in itertools.pairwise(fenced):
            assert before.run.fence is not None and after.run.fence is not None
            if after.run.fence <= before.run.fence:
                report.violations["exclusive"].append(
                    f"key {key!r}: fence not increasing: {_describe(after)} started after "
                    f"{_describe(before)}"
                )


def check_concurrency(history: History, spans: list[_Span], report: Report) -> None:
    capped = sorted((s for s in spans if s.run.key == "capped"), key=lambda s: s.run.start)
    events = sorted(
        [(s.run.start, 1, i) for i, s in enumerate(capped)]
        + [(s.end, -1, i) for i, s in enumerate(capped)]
    )  # at equal times an end (-1) sorts before a start: half-open intervals
    active: set[int] = set()
    most = 0
    for at, delta, i in events:
        if delta < 0:
            active.discard(i)
            continue
        active.add(i)
        most = max(most, len(active))
        if len(active) <= history.limits.cap:
            continue
        members = [capped[j] for j in sorted(active)]
        what = f"{len(active)} running at {at} (cap {history.limits.cap}): " + "; ".join(
            _describe(s) for s in members
        )
        why = next(
            (
                w
                for s in members
                if s is not capped[i] and (w := _lease_may_be_lost(history, s, at))
            ),
            "",
        )
        if why:
            report.known["concurrency-lease-lost"].append(f"{what}: {why}")
        else:
            report.violations["concurrency"].append(what)
    report.counts["capped max running"] = most


def check_unique(history: History, spans: list[_Span], report: Report) -> None:
    for key, group in sorted(_by_key(spans, ("uq:",)).items()):
        for earlier, later in _overlaps(group):
            if earlier.run.task_id != later.run.task_id:
                what = f"key {key!r}: {_describe(earlier)} runs beside {_describe(later)}"
                why = _copy_after_end(history, group, earlier) or _copy_after_end(
                    history, group, later
                )
                if why:
                    report.known["unique-copy-after-end"].append(f"{what}: {why}")
                else:
                    report.violations["unique"].append(what)


def _copy_after_end(history: History, group: list[_Span], span: _Span) -> str:
    """Why ``span`` may run beside another task id of its key: it is a copy of a run of
    its task id that ended, whose pool process (or worker) was killed within
    ``ACK_RELEASE_WINDOW`` of that end, before Celery heard of it. The process had
    recorded the end and freed the unique claim (before its result, so that a caller
    who sees the result may publish anew, worker/pool/run_end.py); Celery redelivers
    the message (``acks_late``, ``reject_on_worker_lost``) and, without the redelivery
    guard, the copy runs (at least once), beside a publish made since ('' : not so)."""
    window = int(ACK_RELEASE_WINDOW * SECOND)
    for first in group:
        if first.run.task_id != span.run.task_id or first.killed or first.end > span.run.start:
            continue
        for fault in history.faults:
            if (
                fault.kind in ("kill_child", *WORKER_DEATHS)
                and first.run.pid in fault.pids
                and fault.start - window <= first.end <= fault.end
            ):
                return (
                    f"a copy of {first.run.task_id}, whose run ended "
                    f"{(fault.start - first.end) / SECOND:.3f} s before its process was "
                    f"killed ({fault.kind}); without the redelivery guard it runs again"
                )
    return ""
