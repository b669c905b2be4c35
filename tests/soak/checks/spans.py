"""Runs as spans (a killed run ends when its kill did), and the moments the checks judge
them against: when a run's ack and its release were due, whether its lease may have run
out, whether its worker died right after it; and how saturated the pools were."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tests.soak.checks.history import (
    BROKER_OUTAGES,
    KILLS,
    SECOND,
    STORE_OUTAGES,
    WORKER_DEATHS,
    Fault,
    History,
    Run,
)


@dataclass(frozen=True)
class _Span:
    """A run with a known end: its own, or the instant the fault that killed it began."""

    run: Run
    end: int
    killed: bool


def _spans(runs: Iterable[Run], faults: Sequence[Fault]) -> tuple[list[_Span], list[Run]]:
    """Runs with an end, and the runs that neither finished nor were killed.

    A killed run's end is when its kill ended: an upper bound, so an overlap is never
    missed (another run of its key cannot start that soon: the key is released only
    ``worker_lost_wait`` after a child died, or ``lease_ttl`` after its worker did).
    """
    kills = sorted((f for f in faults if f.kind in KILLS), key=lambda f: f.start)
    spans: list[_Span] = []
    unexplained: list[Run] = []
    for run in runs:
        if run.end is not None:
            spans.append(_Span(run, run.end, killed=False))
            continue
        # The process was surely dead when the fault ended (orphaned pool processes of a
        # killed worker run on until they are killed in turn, after its main process).
        killer = next((f for f in kills if run.pid in f.pids and f.end >= run.start), None)
        if killer is None:
            unexplained.append(run)
        else:
            spans.append(_Span(run, killer.end, killed=True))
    return spans, unexplained


def _ack_due(history: History, end: int) -> int:
    """When the ack of a run that ended at ``end`` reached the broker at the latest: at
    once (``Limits.slack``), or when the broker answered again after an outage."""
    slack = int(history.limits.slack * SECOND)
    return _outages_until(history, BROKER_OUTAGES, end - slack, end + slack)


#: Seconds within which a worker sends again a release the store did not answer, once
#: the store answers (``worker/unsent.py``: ``PROBE_INTERVAL``).
RELEASE_RETRY = 1.0

#: Seconds after a run's end within which its worker's main process acks it and sends
#: the release of its unique claim (see ``unique-claim-after-ack``).
ACK_RELEASE_WINDOW = 0.25


def _death_right_after(history: History, run: Run) -> Fault | None:
    """The death of ``run``'s worker that began within ``ACK_RELEASE_WINDOW`` of the run's
    end (or during it: its pool outlives the main process for a moment), if any."""
    assert run.end is not None
    window = int(ACK_RELEASE_WINDOW * SECOND)
    return next(
        (
            f
            for f in history.faults
            if f.kind in WORKER_DEATHS
            and run.pid in f.pids
            and f.start - window <= run.end <= f.end
        ),
        None,
    )


def _release_due(history: History, end: int) -> int:
    """When the release of a run that ended at ``end`` (its leases, its unique claim)
    reached the store at the latest: at once (``Limits.slack``); or, when the store was
    paused or down then, within ``RELEASE_RETRY`` of its answering again."""
    slack = int(history.limits.slack * SECOND)
    retry = int(RELEASE_RETRY * SECOND)
    due = end + slack
    moved = True
    while moved:
        moved = False
        for fault in history.faults:
            if (
                fault.kind in STORE_OUTAGES
                and fault.start <= due
                and fault.end >= end - slack
                and fault.end + retry + slack > due
            ):
                due = fault.end + retry + slack
                moved = True
    return due


def _celery_spans(history: History, spans: list[_Span]) -> list[_Span]:
    """``spans`` as Celery's bookkeeping saw them: a run that finished in a pool process
    whose worker's main process died (``kill_worker``, or by itself: ``worker_crash``)
    before the run's ack was due was lost with its worker, like a killed run: its message
    goes back to the broker, and what waits for the ack (a unique claim) ends as a killed
    worker's, from the fault's end. (A pool process runs on for a moment after its main
    process is gone: ``kill_worker`` SIGKILLs the main process first, and a worker that
    dies by itself lets its pool finish its runs.)

    Only the accounting judges these: the run itself did end when the pool process
    says, so overlaps and "ran twice" (guard, beat) are judged on the run's own end."""
    slack = int(history.limits.slack * SECOND)
    deaths = [f for f in history.faults if f.kind in WORKER_DEATHS]
    seen: list[_Span] = []
    for span in spans:
        if not span.killed:
            death = next(
                (
                    f
                    for f in deaths
                    if span.run.pid in f.pids
                    and span.end <= f.end
                    and f.start <= _ack_due(history, span.end) + slack
                ),
                None,
            )
            if death is not None:
                span = _Span(span.run, death.end, killed=True)
        seen.append(span)
    return seen


def _describe(span: _Span) -> str:
    run = span.run
    how = "killed" if span.killed else "end"
    if span.killed and run.end is not None:
        how = f"end {run.end}, lost with its worker at"
    return f"{run.task_id or '?'} [{run.start}, {how} {span.end}) fence={run.fence} pid={run.pid}"


def _lease_may_be_lost(history: History, holder: _Span, until: int) -> str:
    """Why ``holder``'s lease may have run out before ``until`` ('' if it cannot have).

    A live worker renews every ``lease_ttl / 3``; its lease runs out only when the store
    was unreachable for most of ``lease_ttl`` (we ask for half of it) while the run went
    on, or when the worker said so in its log.
    """
    if holder.run.task_id in history.lost_leases:
        return "its worker logged the lease as lost"
    threshold = int(history.limits.lease_ttl * SECOND / 2)
    for fault in history.faults:
        if fault.kind not in STORE_OUTAGES or fault.length < threshold:
            continue
        if fault.end > holder.run.start and fault.start < until:
            return f"{fault.kind} of {fault.length / SECOND:.1f} s while it ran"
    return ""


def _by_key(spans: Iterable[_Span], prefixes: Sequence[str]) -> dict[str, list[_Span]]:
    groups: dict[str, list[_Span]] = defaultdict(list)
    for span in spans:
        if span.run.key.startswith(tuple(prefixes)):
            groups[span.run.key].append(span)
    for group in groups.values():
        group.sort(key=lambda s: (s.run.start, s.end))
    return groups


def _overlaps(group: list[_Span]) -> list[tuple[_Span, _Span]]:
    """Pairs (earlier, later) of runs in one key that overlap (half-open intervals)."""
    pairs = []
    latest: _Span | None = None
    for span in group:
        if latest is not None and span.run.start < latest.end:
            pairs.append((latest, span))
        if latest is None or span.end > latest.end:
            latest = span
    return pairs


def _outages_until(history: History, kinds: Sequence[str], since: int, until: int) -> int:
    """``until`` pushed back by the faults of ``kinds`` that began in ``[since, until]``
    (each one delays what was due then by its length), applied until none is left."""
    counted: set[int] = set()
    moved = True
    while moved:
        moved = False
        for i, fault in enumerate(history.faults):
            if i not in counted and fault.kind in kinds and since <= fault.start <= until:
                counted.add(i)
                until += fault.length
                moved = True
    return until


def saturation(spans: Sequence[_Span], pool_size: int) -> int:
    """Per cent of the time from the first run's start to the last's during which at
    least ``pool_size`` runs were in progress (every pool process of every worker busy):
    how hard the workload pressed. A killed run counts until its kill ended."""
    events = sorted([(s.run.start, 1) for s in spans] + [(s.end, -1) for s in spans])
    if pool_size <= 0 or not events:
        return 0
    first = min(s.run.start for s in spans)
    last = max(s.run.start for s in spans)
    busy = running = 0
    since = first
    for at, delta in events:
        at = min(max(at, first), last)
        if running >= pool_size:
            busy += at - since
        since = at
        running += delta
    return round(100 * busy / max(1, last - first))
