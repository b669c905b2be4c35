"""The nemesis soak's checker: pure functions over a recorded :class:`History`.

Nothing here talks to a server or trusts the library: the history was written by the
observer (runs, on its server's clock), by the publisher (what it sent and what it was
told), by the workers' ``task_skipped`` signal (skips), by the nemesis (faults, on the
same clock) and read back from the result backend and the workers' logs. Each check
returns the violations it found; some overlaps are *known windows* (documented in
docs/failure.md) and are counted apart, never silently dropped.

The checks (each a function named ``check_*``):

* ``exclusive``  -- no two runs of one exclusive key overlap, and fences grow in start
  order. Known window: the earlier run's lease was lost (its worker logged the loss, or
  the store was unreachable for long enough that the lease ran out while it ran).
* ``concurrency`` -- never more than the cap running at one instant (same known window).
* ``unique`` -- no two task ids of one unique key run at once.
* ``guard`` -- a redelivery-guarded task id never runs twice (at most one finished run,
  no two runs at once).
* ``beat`` -- a beat slot runs once (at most one finished run, no two at once).
* ``rate-start`` -- starts (the observer's stamp at the body's first line: where the
  user meets the limit) never exceed ``burst + rate * (window + START_TOLERANCE)`` in
  any window.
* ``rate`` -- admissions (the runs' fences, the store's TIME in microseconds) never
  exceed ``burst + rate * window`` in any window.
* ``accounting`` -- every published id ran, or is accounted for: a skip recorded by the
  worker with the reason (a skipped exclusive duplicate also has its ``TaskSkipped``
  result), a deduplicated publish (``TaskDeduplicated`` result, against a holder that
  was really queued or running), or an expiry (``REVOKED``). A skip must name a holder
  that was really running.

Times are integers: microseconds by the observer server's clock.
"""

from __future__ import annotations

import itertools
import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

SECOND = 1_000_000

#: Fault kinds during which the store answers nothing (its leases may run out meanwhile).
STORE_OUTAGES = ("pause_store", "restart_store")
#: Fault kinds during which the broker answers nothing (acks wait meanwhile).
BROKER_OUTAGES = ("pause_broker", "restart_broker")
#: A worker whose main process died without the nemesis killing it (recorded when the
#: nemesis noticed; Celery 5.7's consumer dies on some broker restarts, issue 11).
WORKER_CRASH = "worker_crash"
#: Fault kinds that end processes (their runs end when the fault ends).
KILLS = ("kill_child", "kill_worker", "kill_beat", WORKER_CRASH)
#: Fault kinds that end a worker's main process (its pool may finish a run meanwhile).
WORKER_DEATHS = ("kill_worker", WORKER_CRASH)


@dataclass(frozen=True)
class Run:
    """One run as the observer saw it. ``end`` is None when it never finished."""

    key: str
    task_id: str
    start: int
    end: int | None = None
    fence: int | None = None
    pid: int = 0


@dataclass(frozen=True)
class Fault:
    """One injected fault ``[start, end]``; ``pids`` are the processes a kill ended."""

    kind: str
    start: int
    end: int
    pids: tuple[int, ...] = ()
    detail: str = ""

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Published:
    """One publish: ``outcome`` is ``sent``, ``deduplicated`` (into ``into``) or ``failed``."""

    task_id: str
    task: str
    at: int
    outcome: str = "sent"
    into: str = ""
    detail: str = ""


@dataclass(frozen=True)
class Skip:
    """A delivery the worker did not run, as its ``task_skipped`` signal reported it."""

    task_id: str
    reason: str
    at: int
    holder: str = ""
    key: str = ""
    task: str = ""


@dataclass(frozen=True)
class Limits:
    """What the soak app declares (tests.apps.soak)."""

    lease_ttl: float = 6.0
    cap: int = 2
    rate: float = 4.0
    burst: int = 2
    #: How late after its holder ended a skip or a deduplication may still be legitimate
    #: (the release travels from the pool child through the main process to the store).
    slack: float = 2.0
    #: How long after a worker was killed the broker may give its unacknowledged messages
    #: back (a Redis broker: ``visibility_timeout``, plus its restore interval and restore
    #: mutex). Until then a killed run's unique key is still its own (docs/failure.md).
    redelivery: float = 25.0
    #: Beat entries with a fixed period (seconds): their slots are at least that far apart.
    beat_periods: dict[str, float] = field(default_factory=lambda: {"every1": 1.0})
    #: Pool processes of all workers together (0: unknown): for the saturation count.
    pool_size: int = 0


@dataclass
class History:
    """Everything recorded in one soak run."""

    runs: list[Run]
    published: list[Published] = field(default_factory=list)
    skips: list[Skip] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    #: task id -> ``"STATE"`` or ``"STATE:ExceptionType"`` from the result backend.
    results: dict[str, str] = field(default_factory=dict)
    #: task ids whose worker logged that their lease was lost.
    lost_leases: set[str] = field(default_factory=set)
    limits: Limits = field(default_factory=Limits)
    #: task ids some worker logged as received (Celery's strategy, before celery-baton
    #: sees the message); None: not recorded (a history from before it was).
    received: set[str] | None = None
    #: task id -> when (us) a worker last handed it to the broker (a hand-back at the
    #: horizon, or a put-back after a reconnect) and no worker logged it after that.
    to_broker: dict[str, int] = field(default_factory=dict)


def load_history(data: dict[str, Any]) -> History:
    """A History from its JSON form (``history.json`` of a soak's log directory)."""
    return History(
        runs=[Run(**r) for r in data["runs"]],
        published=[Published(**p) for p in data["published"]],
        skips=[Skip(**s) for s in data["skips"]],
        faults=[Fault(**{**f, "pids": tuple(f["pids"])}) for f in data["faults"]],
        results=dict(data["results"]),
        lost_leases=set(data["lost_leases"]),
        limits=Limits(**data["limits"]),
        received=set(data["received"]) if "received" in data else None,
        to_broker={k: int(v) for k, v in data.get("to_broker", {}).items()},
    )


@dataclass
class Report:
    """Violations and known windows per check, and what was seen."""

    seed: int | None = None
    violations: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    known: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    counts: dict[str, int] = field(default_factory=dict)
    #: Workers that died by themselves: no verdict on the guarantees, but a bug to find.
    crashes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(self.violations.values())

    def failed_checks(self) -> list[str]:
        return sorted(name for name, found in self.violations.items() if found)

    def summary(self, shown: int = 8) -> str:
        lines = [f"nemesis soak seed={self.seed}: " + ("OK" if self.ok else "FAILED")]
        lines.append("  seen: " + ", ".join(f"{k}={v}" for k, v in sorted(self.counts.items())))
        if self.crashes:
            lines.append(
                f"  WORKER CRASHES: {len(self.crashes)} worker(s) died by themselves, not "
                "killed by the nemesis (a bug to find: docs/soak.md; their runs "
                "are judged as a killed worker's)"
            )
            lines += [f"    {line}" for line in self.crashes]
        for title, groups in (("VIOLATION", self.violations), ("known window", self.known)):
            for name, found in sorted(groups.items()):
                if not found:
                    continue
                lines.append(f"  {title} {name}: {len(found)}")
                lines += [f"    {line}" for line in found[:shown]]
                if len(found) > shown:
                    lines.append(f"    ... {len(found) - shown} more")
        if self.seed is not None and not self.ok:
            lines.append(f"  replay: python -m tests.soak.nemesis --seed {self.seed}")
        return "\n".join(lines)


# -- building runs ------------------------------------------------------------------------


def merge_runs(started: Iterable[dict[str, Any]], finished: Iterable[dict[str, Any]]) -> list[Run]:
    """One :class:`Run` per start entry of the observer, with its end if it finished."""
    ends: dict[tuple[str, str, int, int], list[int]] = defaultdict(list)
    for entry in finished:
        ends[_identity(entry)].append(int(entry["end"]))
    runs = []
    for entry in started:
        found = ends.get(_identity(entry))
        end = found.pop(0) if found else None
        fence = entry.get("fence")
        runs.append(
            Run(
                key=str(entry["key"]),
                task_id=str(entry.get("task_id") or ""),
                start=int(entry["start"]),
                end=end,
                fence=int(fence) if fence is not None else None,
                pid=int(entry.get("pid") or 0),
            )
        )
    return runs


def _identity(entry: dict[str, Any]) -> tuple[str, str, int, int]:
    return (str(entry["key"]), str(entry.get("task_id") or ""), int(entry["start"]), entry["pid"])


_LOST = re.compile(r"lost its lease \S+ \(owner ([^|\s)]+)|lease lost: \S+ held by ([^|\s]+)\|")


_RECEIVED = re.compile(r"\] Task [\w.]+\[([0-9a-f-]{36})\] received$", re.M)


def received_task_ids(log_text: str) -> set[str]:
    """Task ids a worker's log says it received (Celery's INFO line, logged before any
    of celery-baton's consumer code sees the message)."""
    return set(_RECEIVED.findall(log_text))


_LOG_AT = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}): [^\]]*\] (.*)$", re.M)
_HANDED = re.compile(r"\[([0-9a-f-]{36})\] handed back to the broker")
_PUT_BACK = re.compile(r"held messages put back in their queues .*?: (.*)$")
_NAMED = re.compile(r"\[([0-9a-f-]{36})\]")


def broker_moments(log_text: str) -> dict[str, tuple[int, bool]]:
    """Each task id's last moment in a worker's log (us since the epoch, local clock),
    and whether it was handed to the broker then (handed back, or put back after a
    reconnect) rather than received or worked on."""
    last: dict[str, tuple[int, bool]] = {}
    for stamp, text in _LOG_AT.findall(log_text):
        at = int(datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp() * SECOND)
        put_back = _PUT_BACK.search(text)
        if put_back:
            for task_id in put_back.group(1).split(", "):
                last[task_id] = (at, True)
            continue
        handed = _HANDED.search(text)
        for task_id in _NAMED.findall(text):
            last[task_id] = (at, bool(handed) and task_id == handed.group(1))
    return last


def lost_lease_task_ids(log_text: str) -> set[str]:
    """Task ids whose lease a worker's log says was lost (celery_baton's ERROR lines)."""
    return {a or b for a, b in _LOST.findall(log_text)}


_LOGGED = re.compile(
    r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}): (CRITICAL|ERROR)/MainProcess\] (.*)$", re.M
)
_EXCEPTION = re.compile(r"^(\w+(?:\.\w+)*(?:Error|Exception)\b.*)$", re.M)


def crash_reason(log_text: str) -> tuple[str, float | None]:
    """Why a worker's main process died, from its log: Celery's ``Unrecoverable error``
    line (else its last CRITICAL line, else the last exception line) and, when the line
    has one, its time (seconds since the epoch, the worker's local clock)."""
    logged = _LOGGED.findall(log_text)
    chosen = next((e for e in reversed(logged) if "Unrecoverable error" in e[2]), None)
    chosen = chosen or next((e for e in reversed(logged) if e[1] == "CRITICAL"), None)
    if chosen is not None:
        at = datetime.strptime(chosen[0], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        return chosen[2].strip()[:300], at
    found = _EXCEPTION.findall(log_text)
    return (found[-1].strip()[:300] if found else ""), None


# -- helpers ---------------------------------------------------------------------------


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


#: Seconds around a worker's SIGKILL in which a message it was taking off the queue
#: may be lost by kombu's Redis transport (see ``lost-in-transport``).
TRANSPORT_WINDOW = 0.25


#: Seconds within which a message a worker handed back to the broker (at the hold
#: horizon, or put back after a reconnect) is delivered again, on a loaded machine.
REDELIVERY_WINDOW = 3.0
#: Seconds a fault's recorded start may come after what it caught: it is recorded just
#: before the signal is sent, and the process dies a few milliseconds later.
KILL_SLACK = 0.5


def _lost_in_transport(history: History, pub: Published) -> Fault | None:
    """The fault that may have lost ``pub`` in kombu's Redis transport before any worker
    received it: a worker SIGKILLed as it was published (and taken off the queue), or the
    broker SIGKILLed after it was published, while it may still have been waiting in
    the queue. None if some worker logged it received (then it was ours to keep)."""
    handed = history.to_broker.get(pub.task_id)
    if handed is not None:
        # Received, then handed back to the broker and never seen again: delivered
        # anew, and exposed to the same window as a first delivery, moments later.
        return next(
            (
                f
                for f in history.faults
                if f.kind == "restart_broker"
                and -KILL_SLACK * SECOND <= f.start - handed <= REDELIVERY_WINDOW * SECOND
            ),
            None,
        )
    if history.received is not None and pub.task_id in history.received:
        return None
    window = int(TRANSPORT_WINDOW * SECOND)
    waited = int(history.limits.redelivery * SECOND)
    return next(
        (
            f
            for f in history.faults
            if (f.kind == "kill_worker" and f.start - window <= pub.at <= f.end + window)
            or (f.kind == "restart_broker" and pub.at <= f.start <= pub.at + waited)
        ),
        None,
    )


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


# -- the checks --------------------------------------------------------------------------


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
                report.violations["unique"].append(
                    f"key {key!r}: {_describe(earlier)} runs beside {_describe(later)}"
                )


def _once(history: History, spans: list[_Span], prefix: str, name: str, report: Report) -> None:
    for key, group in sorted(_by_key(spans, (prefix,)).items()):
        for earlier, later in _overlaps(group):
            report.violations[name].append(
                f"{key!r}: {_describe(earlier)} and {_describe(later)} at once"
            )
        finished = [s for s in group if not s.killed]
        if len(finished) < 2:
            continue
        what = f"{key!r} ran {len(finished)} times: " + "; ".join(_describe(s) for s in finished)
        # Its end is recorded (the done marker) by the pool process right after the body:
        # a worker killed in that moment takes the record with it, and the copy runs.
        # Only the last run may have been recorded.
        unrecorded = [
            (s, death)
            for s in sorted(finished, key=lambda s: s.run.start)[:-1]
            if (death := _death_right_after(history, s.run)) is not None
        ]
        if len(unrecorded) == len(finished) - 1:
            span, death = unrecorded[0]
            assert span.run.end is not None
            report.known["run-end-unrecorded"].append(
                f"{what}; the first's worker died {(death.start - span.run.end) / SECOND:+.3f} s"
                f" from its end ({death.kind}), before its pool process recorded it"
            )
        else:
            report.violations[name].append(what)


def check_guard(history: History, spans: list[_Span], report: Report) -> None:
    _once(history, spans, "guarded:", "guard", report)


def check_beat(history: History, spans: list[_Span], report: Report) -> None:
    for span in spans:
        if span.run.key.startswith("beat:") and span.run.key.endswith("|None"):
            report.violations["beat"].append(f"a tick without its slot header: {_describe(span)}")
    _once(history, spans, "beat:", "beat", report)
    report.counts["beat slots"] = len(_by_key(spans, ("beat:",)))
    # Two leaders (say, beats that do not share one store) fire every tick twice, each
    # under a slot of its own: one entry's slots closer than its period give that away.
    for entry, period in history.limits.beat_periods.items():
        slots = sorted(
            {
                int(slot)
                for span in spans
                for name, _, slot in [span.run.key.removeprefix("beat:").partition("|")]
                if span.run.key.startswith("beat:") and name == entry and slot.isdigit()
            }
        )
        close = [(a, b) for a, b in itertools.pairwise(slots) if b - a < period * 1000]
        if close:
            shown = ", ".join(f"{a}/{b}" for a, b in close[:5])
            report.violations["beat"].append(
                f"{entry} (every {period:g} s): {len(close)} pair(s) of slots closer than its "
                f"period, i.e. ticks fired more than once: {shown}"
            )


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


def _ran_around(spans: Sequence[_Span], since: int, at: int, slack: int, killed_slack: int) -> bool:
    """Whether one of these runs of a task id held (or was about to hold) its key at some
    instant of ``[since, at]``: queued or admitted (it starts later), or running."""
    for span in spans:
        after = killed_slack if span.killed else slack
        if (span.run.start - slack <= at and span.end + after >= since) or span.run.start > at:
            return True
    return False


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


def _discarded(history: History, pub: Published, holder: list[_Span]) -> bool:
    """Whether ``pub`` was deduplicated into a run killed with its worker whose copy,
    given back by the broker, was discarded (REVOKED) rather than run again."""
    last = max(holder, key=lambda s: s.end)
    later = any(s.run.start > pub.at for s in holder)
    return last.killed and not later and history.results.get(pub.into) == "REVOKED"


def _judge_late_holder(
    history: History, pub: Published, holder: list[_Span], report: Report
) -> None:
    """A publish deduplicated into a holder that was neither running nor ran again later.

    The key is the holder's until Celery is done with its message, not until its run
    ended: a run that finished while the broker was down keeps its key until its ack
    went through (the ack comes first, then the key is freed). A run killed with its
    worker keeps it until the broker gives the message back (``Limits.redelivery``),
    and the copy then runs (not this case: it ran later); but a run whose message
    expires holds its key only while it lives (renewed; lapsing within ``lease_ttl``
    of its death), since a copy given back expired is discarded (REVOKED). A publish
    deduplicated into such a holder before its claim lapsed is the known window
    "unique-expired-holder": its caller gets the holder's REVOKED result.
    """
    limits = history.limits
    slack = int(limits.slack * SECOND)
    last = max(holder, key=lambda s: s.end)
    what = (
        f"{pub.task} {pub.task_id} deduplicated at {pub.at} into {pub.into}, which was no "
        "longer queued or running: " + "; ".join(_describe(s) for s in holder)
    )
    if not last.killed:
        if pub.at <= max(_ack_due(history, last.end), _release_due(history, last.end)) + slack:
            report.counts["dedup while the holder's ack waited"] = (
                report.counts.get("dedup while the holder's ack waited", 0) + 1
            )
            return
        report.violations["accounting"].append(what)
        return
    result = history.results.get(pub.into, "")
    if last.run.end is not None and result.startswith(("SUCCESS", "FAILURE")):
        death = _death_right_after(history, last.run)
        if death is not None:
            # Finished and acked (its message never came back: it did not run again),
            # but its worker died before the claim's release went out (docs/soak.md).
            report.known["unique-claim-after-ack"].append(
                f"{what}; its worker died {(death.start - last.run.end) / SECOND:.3f} s after"
                f" the run ended ({death.kind}), after its ack, before its claim's release"
            )
            return
    sent = next((p for p in history.published if p.task_id == pub.into), None)
    if sent is not None and "expires=" in sent.detail:
        # Its run held the claim while it lived: lost with its worker, the claim lapsed
        # within lease_ttl (the message's expiry is shorter in the soak).
        back_by = last.end + int(limits.lease_ttl * SECOND)
        how = f"{limits.lease_ttl:g} s (lease_ttl) after its run was killed"
    else:
        back_by = _outages_until(
            history, BROKER_OUTAGES, last.end, last.end + int(limits.redelivery * SECOND)
        )
        how = "the broker gave its message back"
    if pub.at > back_by + slack:
        report.violations["accounting"].append(f"{what} (later than {how}, at {back_by})")
    elif result == "REVOKED":
        report.known["unique-expired-holder"].append(
            f"{what}; its copy came back expired and was discarded (REVOKED)"
        )
    elif result == "" or pub.at > last.end + int((limits.lease_ttl + limits.slack) * SECOND):
        report.violations["accounting"].append(f"{what} (its result is {result or 'missing'})")


def check_accounting(history: History, spans: list[_Span], report: Report) -> None:
    limits = history.limits
    slack = int(limits.slack * SECOND)
    # A killed worker's leases and claims live on until lease_ttl.
    killed_slack = int((limits.lease_ttl + limits.slack) * SECOND)
    by_id: dict[str, list[_Span]] = defaultdict(list)
    for span in spans:
        by_id[span.run.task_id].append(span)
    ran = {r.task_id for r in history.runs}
    skips: dict[str, list[Skip]] = defaultdict(list)
    for skip in history.skips:
        skips[skip.task_id].append(skip)
    published = {p.task_id: p for p in history.published if p.outcome == "sent"}
    sent_at: dict[str, int] = {}
    for pub in history.published:
        if pub.outcome == "sent":
            sent_at.setdefault(pub.task_id, pub.at)
    outcomes: dict[str, int] = defaultdict(int)
    for pub in history.published:
        outcomes[pub.outcome] += 1
        if pub.outcome == "failed":
            continue
        if pub.outcome == "deduplicated":
            result = history.results.get(pub.task_id, "")
            if result != "FAILURE:TaskDeduplicated":
                report.violations["accounting"].append(
                    f"{pub.task} {pub.task_id} deduplicated into {pub.into} but its result is "
                    f"{result or 'missing'} (expected a TaskDeduplicated failure)"
                )
            holder = by_id.get(pub.into, [])
            if pub.into not in published and not holder:
                tried = next((p for p in history.published if p.task_id == pub.into), None)
                how = (
                    f"whose publish failed ({tried.detail.strip()})" if tried else "never published"
                )
                report.violations["accounting"].append(
                    f"{pub.task} {pub.task_id} deduplicated at {pub.at} into {pub.into}, {how}, "
                    "which never ran"
                )
            elif holder and (
                _discarded(history, pub, holder)
                or not _ran_around(holder, pub.at, pub.at, slack, killed_slack)
            ):
                _judge_late_holder(history, pub, holder, report)
            continue
        if pub.task_id in ran:
            continue
        found = skips.get(pub.task_id)
        if found:
            continue  # each skip is judged below
        if history.results.get(pub.task_id, "").startswith("REVOKED"):
            report.known["expired"].append(f"{pub.task} {pub.task_id}: expired before it ran")
            continue
        fault = None if history.results.get(pub.task_id) else _lost_in_transport(history, pub)
        if fault is not None:
            # kombu's Redis transport takes a message off the queue (BRPOP) and only then
            # records it as unacked (HSET), before Celery sees it: a worker SIGKILLed
            # between the two, or a broker SIGKILLed after the first (its reply, or the
            # record, lost), loses it before Celery or celery-baton saw it. Not ours to
            # close; RabbitMQ has no such window.
            handed = history.to_broker.get(pub.task_id)
            report.known["lost-in-transport"].append(
                f"{pub.task} {pub.task_id} handed back to the broker at {handed}, "
                f"{(fault.start - handed) / SECOND:.3f} s before a {fault.kind}, never "
                "received again (kombu Redis: BRPOP, then the unacked record)"
                if handed is not None
                else f"{pub.task} {pub.task_id} published at {pub.at}, "
                f"{(fault.start - pub.at) / SECOND:+.3f} s from a {fault.kind}, never received"
                " by any worker (kombu Redis: BRPOP, then the unacked record)"
            )
            continue
        report.violations["accounting"].append(
            f"{pub.task} {pub.task_id} published at {pub.at} never ran and is not accounted for "
            f"(result: {history.results.get(pub.task_id) or 'none'})"
        )
    for skip in history.skips:
        if skip.reason == "already-run":
            if skip.task_id not in ran:
                report.violations["accounting"].append(
                    f"{skip.task_id} skipped as already run, but it never ran"
                )
            continue
        if skip.reason != "exclusive":
            report.violations["accounting"].append(
                f"{skip.task} {skip.task_id} skipped for {skip.reason!r}"
            )
            continue
        if skip.task_id not in ran:
            result = history.results.get(skip.task_id, "")
            if result != "FAILURE:TaskSkipped":
                report.violations["accounting"].append(
                    f"{skip.task} {skip.task_id} skipped (held by {skip.holder}) but its result "
                    f"is {result or 'missing'} (expected a TaskSkipped failure)"
                )
        # A duplicate that arrived while its holder ran may be skipped later (it waits out
        # a grace, or the store was down meanwhile): judge from its publish on.
        since = min(sent_at.get(skip.task_id, skip.at), skip.at)
        holder = by_id.get(skip.holder, [])
        if holder and not _ran_around(holder, since, skip.at, slack, killed_slack):
            last = max(holder, key=lambda s: s.end)
            if not last.killed and skip.at <= _release_due(history, last.end):
                # It ended while the store was down: its lease was freed once the store
                # answered again (counted, not a violation).
                report.counts["skipped while the holder's release waited"] = (
                    report.counts.get("skipped while the holder's release waited", 0) + 1
                )
                continue
        if not holder or not _ran_around(holder, since, skip.at, slack, killed_slack):
            report.violations["accounting"].append(
                f"{skip.task} {skip.task_id} skipped at {skip.at} as held by {skip.holder}, "
                "which was not running then: "
                + ("; ".join(_describe(s) for s in holder) or "it never ran")
            )
    for name, n in outcomes.items():
        report.counts[f"published {name}"] = n
    report.counts["skips"] = len(history.skips)


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
    if history.limits.pool_size:
        report.counts["pool saturated %"] = saturation(spans, history.limits.pool_size)
        report.counts["busy runs"] = sum(1 for r in history.runs if r.key == "busy")
    check_accounting(history, _celery_spans(history, spans), report)
    crashes = [f for f in history.faults if f.kind == WORKER_CRASH]
    report.counts["worker crashes"] = len(crashes)
    report.crashes = [f"at {f.end}: {f.detail}" for f in crashes]
    return report


__all__ = [
    "Fault",
    "History",
    "Limits",
    "Published",
    "Report",
    "Run",
    "Skip",
    "check",
    "crash_reason",
    "load_history",
    "lost_lease_task_ids",
    "merge_runs",
]


if __name__ == "__main__":  # python -m tests.soak.checker <log dir>/history.json
    import json
    import sys
    from pathlib import Path

    print(check(load_history(json.loads(Path(sys.argv[1]).read_text()))).summary(shown=50))
