"""The nemesis soak's checker: pure functions over a recorded :class:`History`.

Nothing here talks to a server or trusts the library: the history was written by the
observer (runs, on its server's clock), by the publisher (what it sent and what it was
told), by the workers' ``task_skipped`` signal (skips), by the nemesis (faults, on the
same clock) and read back from the result backend and the workers' logs. Each check
returns the violations it found; some overlaps are *known windows* (documented in
docs/failure.md) and are counted apart, never silently dropped.

The checks (each a function named ``check_*``), a module of :mod:`tests.soak.checks` per
group, each describing its checks: :mod:`~tests.soak.checks.exclusive` (``exclusive``,
``concurrency``, ``unique``), :mod:`~tests.soak.checks.once` (``guard``, ``beat``),
:mod:`~tests.soak.checks.rate` (``rate-start``, ``rate``),
:mod:`~tests.soak.checks.keyed` (``ordered``, ``batched``),
:mod:`~tests.soak.checks.cancels` (``cancel``) and
:mod:`~tests.soak.checks.accounting` (``accounting``). They read the
:mod:`~tests.soak.checks.history`, built by :mod:`~tests.soak.checks.records`, through
:mod:`~tests.soak.checks.spans`. Every public name of those modules is importable from
here.
"""

from __future__ import annotations

from tests.soak.checks.accounting import (
    KILL_SLACK,
    REDELIVERY_WINDOW,
    TRANSPORT_WINDOW,
    check_accounting,
)
from tests.soak.checks.cancels import CANCEL_TASKS, HAND_OVER, check_cancels
from tests.soak.checks.exclusive import check_concurrency, check_exclusive, check_unique
from tests.soak.checks.history import (
    BROKER_OUTAGES,
    KILLS,
    SECOND,
    STORE_OUTAGES,
    WORKER_CRASH,
    WORKER_DEATHS,
    Cancel,
    Fault,
    History,
    Limits,
    Published,
    Report,
    Run,
    Skip,
    load_history,
)
from tests.soak.checks.keyed import check_batched, check_ordered
from tests.soak.checks.once import check_beat, check_guard
from tests.soak.checks.rate import START_TOLERANCE, check_rate
from tests.soak.checks.records import (
    broker_moments,
    crash_reason,
    lost_lease_task_ids,
    merge_runs,
    ordered_log_notes,
    received_moments,
    received_task_ids,
    unchecked_cancel_ids,
)
from tests.soak.checks.spans import (
    ACK_RELEASE_WINDOW,
    RELEASE_RETRY,
    _celery_spans,
    _spans,
    saturation,
)


def check(history: History, seed: int | None = None) -> Report:
    """Run every check over ``history``."""
    report = Report(seed=seed)
    spans, unexplained = _spans(history.runs, history.faults)
    for run in unexplained:
        report.known["unfinished"].append(
            f"{run.key} {run.task_id} started at {run.start} (pid {run.pid}), never ended and "
            "no recorded kill explains it"
        )
    report.counts["runs"] = len(history.runs)
    report.counts["faults"] = len(history.faults)
    check_exclusive(history, spans, report)
    check_concurrency(history, spans, report)
    check_unique(history, spans, report)
    check_guard(history, spans, report)
    check_beat(history, spans, report)
    check_rate(history, history.runs, report)
    check_ordered(history, spans, report)
    check_batched(history, spans, report)
    check_cancels(history, spans, report)
    if history.limits.pool_size:
        report.counts["pool saturated %"] = saturation(spans, history.limits.pool_size)
        report.counts["busy runs"] = sum(1 for r in history.runs if r.key == "busy")
    check_accounting(history, _celery_spans(history, spans), report)
    crashes = [f for f in history.faults if f.kind == WORKER_CRASH]
    report.counts["worker crashes"] = len(crashes)
    report.crashes = [f"at {f.end}: {f.detail}" for f in crashes]
    return report


#: The checker's names, and those of the checks' modules that the nemesis and the tests
#: import from here.
__all__ = [
    "ACK_RELEASE_WINDOW",
    "BROKER_OUTAGES",
    "CANCEL_TASKS",
    "HAND_OVER",
    "KILLS",
    "KILL_SLACK",
    "REDELIVERY_WINDOW",
    "RELEASE_RETRY",
    "SECOND",
    "START_TOLERANCE",
    "STORE_OUTAGES",
    "TRANSPORT_WINDOW",
    "WORKER_CRASH",
    "WORKER_DEATHS",
    "Cancel",
    "Fault",
    "History",
    "Limits",
    "Published",
    "Report",
    "Run",
    "Skip",
    "broker_moments",
    "check",
    "check_accounting",
    "check_batched",
    "check_beat",
    "check_cancels",
    "check_concurrency",
    "check_exclusive",
    "check_guard",
    "check_ordered",
    "check_rate",
    "check_unique",
    "crash_reason",
    "load_history",
    "lost_lease_task_ids",
    "merge_runs",
    "ordered_log_notes",
    "received_moments",
    "received_task_ids",
    "saturation",
    "unchecked_cancel_ids",
]


if __name__ == "__main__":  # python -m tests.soak.checker <log dir>/history.json
    import json
    import sys
    from pathlib import Path

    print(check(load_history(json.loads(Path(sys.argv[1]).read_text()))).summary(shown=50))
