"""What one soak run recorded (:class:`History`), and what the checks found (:class:`Report`).

Times are integers: microseconds by the observer server's clock.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
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
class Cancel:
    """One ``baton.cancel`` the publisher made: of ``task_id``, or of every call of
    ``task`` with ``key`` published until then. ``at``: when it returned (or raised: then
    ``failed``, and it is not judged), by the history's clock; ``ttl``: seconds it is
    kept, as it said."""

    at: int
    task_id: str = ""
    task: str = ""
    key: str = ""
    failed: bool = False
    ttl: float = 0.0
    detail: str = ""


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
    #: The broker client's ``socket_timeout``: an ack sent to a broker paused longer
    #: than this fails (kombu's "Couldn't ack"), and the message comes back.
    broker_socket_timeout: float = 5.0
    #: Beat entries with a fixed period (seconds): their slots are at least that far apart.
    beat_periods: dict[str, float] = field(default_factory=lambda: {"every1": 1.0})
    #: Pool processes of all workers together (0: unknown): for the saturation count.
    pool_size: int = 0
    #: ``ordered_gap_timeout`` of the ordered task (seconds): a position is skipped only
    #: once its key's next call has not come for this long.
    ordered_gap: float = 30.0


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
    #: task id -> its result's value (ordered and batched calls: what its caller got).
    values: dict[str, Any] = field(default_factory=dict)
    #: The workers' logged gap skips of ordered keys: (the key as logged, e.g.
    #: ``{"key":"p"}``, the positions skipped, e.g. ``12`` or ``12-13``, when: us, the
    #: worker's clock, on the observer's host).
    order_skips: list[tuple[str, str, int]] = field(default_factory=list)
    #: Ordered task ids a worker logged as placed under an order record the store no
    #: longer had (they run in arrival order: documented).
    order_lost: set[str] = field(default_factory=set)
    #: The publisher's ``baton.cancel`` calls (tests.soak.checks.cancels).
    cancels: list[Cancel] = field(default_factory=list)
    #: task id -> the moments (us, the workers' clock, on the observer's host) a worker
    #: logged it received (of the ``cancelled`` kind's calls only).
    received_at: dict[str, list[int]] = field(default_factory=dict)
    #: task ids a worker logged it could not ask the store about a cancel (it ran).
    cancel_unchecked: set[str] = field(default_factory=set)


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
        values=dict(data.get("values", {})),
        order_skips=[
            (str(s[0]), str(s[1]), int(s[2]) if len(s) > 2 else 0)
            for s in data.get("order_skips", [])
        ],
        order_lost=set(data.get("order_lost", [])),
        cancels=[Cancel(**c) for c in data.get("cancels", [])],
        received_at={k: [int(x) for x in v] for k, v in data.get("received_at", {}).items()},
        cancel_unchecked=set(data.get("cancel_unchecked", [])),
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
