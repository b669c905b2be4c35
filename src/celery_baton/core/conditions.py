"""The gate's conditions: one type per kind, with named fields. Celery-free.

A delivery's plan is a list of these (policy/plan.py, fairness.py, shared_limits.py
build them); the gate script checks them in order and a denial names the first that
failed (``Decision.denied_by``). ``encode`` writes each for gate.lua, a letter and two
values, here and nowhere else; the kind's fragment of gate.lua (store/lua/gate/) says
what they mean on the store's side.

Every condition has the ``key`` it is decided on: a script's keys must share one Redis
Cluster slot, so the gate groups conditions by the key's hash tag (``slot_groups``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from celery_baton.store.schema import hash_tag


@dataclass(frozen=True, slots=True)
class TakeLease:
    """One of ``limit`` leases of ``key`` (1: exclusive); ``fence``: the grant carries a
    fencing token, strictly increasing per key."""

    key: str
    limit: int = 1
    fence: bool = False


@dataclass(frozen=True, slots=True)
class Rate:
    """A GCRA rate: one start per ``interval_us`` microseconds, ``burst`` at once."""

    key: str
    interval_us: int
    burst: int = 1


@dataclass(frozen=True, slots=True)
class WeightedRate:
    """A named limit's GCRA rate, weighted: a call of cost ``n`` adds ``n`` emission
    intervals (``increment_us``); ``tolerance_us`` is burst x interval."""

    key: str
    increment_us: int
    tolerance_us: int


@dataclass(frozen=True, slots=True)
class Penalty:
    """Denied while a named limit's penalty (``penalize``) lasts."""

    key: str


@dataclass(frozen=True, slots=True)
class Override:
    """The next condition's limit, if ``field`` of hash ``key`` is set (runtime edits:
    ``celery baton limits set``)."""

    key: str
    field: str


@dataclass(frozen=True, slots=True)
class NotDone:
    """Denies a copy of a publish of ``task_id`` that already finished: one whose
    ``stamp`` (its publish, policy/headers.PUBLISH_HEADER) is recorded in ``key``; with
    no stamp (a message sent without celery-baton), any finished run of the id. Also
    denies a copy of an attempt that retried: ``attempt_stamp(stamp, attempt)``
    recorded (``attempt``: the delivery's Celery ``retries``); its retry, one attempt
    later, runs."""

    key: str
    stamp: str = ""
    task_id: str = ""
    attempt: int = 0


def attempt_stamp(stamp: str, attempt: int) -> str:
    """What the done marker records for ``attempt`` of the publish ``stamp`` when that
    attempt retried: the retry keeps the stamp (publish.py) and runs as the next
    attempt, while a copy of the retried message must not run (gate/done.lua)."""
    return f"{stamp}@{attempt}"


@dataclass(frozen=True, slots=True)
class SlotNotRun:
    """Denies a scheduled beat slot (``slot``, ms) that its entry's run record ``key``
    holds (policy/slot_runs.py): a copy of a slot that ran."""

    key: str
    slot: int
    task_id: str


@dataclass(frozen=True, slots=True)
class PublishOrder:
    """Denies a delivery that a newer publish of the same exclusive key superseded
    (``order``: its publish order, None: the gate gives one now); else records it as
    the newest."""

    key: str
    order: int | None
    task_id: str


@dataclass(frozen=True, slots=True)
class InOrder:
    """The turn of a call of an ordered key (core/ordered.py): passes only when its
    ``place`` (``"<epoch>:<position>"``; '' : none, the gate gives it one) is the key's
    next; the condition after it must be the key's exclusive lease. ``gap_ms``: how
    long a missing position may hold the key; ``life_ms``: the record's life."""

    key: str
    place: str
    gap_ms: int
    life_ms: int


@dataclass(frozen=True, slots=True)
class NotSuperseded:
    """Denies a delivery that a unique ``replace`` publish superseded; on grant marks it
    started (for ``ttl`` seconds), so a later replace leaves it running."""

    key: str
    ttl: float


@dataclass(frozen=True, slots=True)
class NotCancelled:
    """Denies a delivery of ``task_id`` while its cancel record ``key`` exists
    (``baton.cancel``, core/cancels.py). On one server only: the record's hash tag is the
    id, never the task's."""

    key: str
    task_id: str


@dataclass(frozen=True, slots=True)
class ClaimUnique:
    """Denied while another task id holds the unique claim ``key``; on grant, the claim
    is ``task_id``'s for ``ttl`` seconds. For a call published where its task's options
    were unknown (nothing was claimed at its publish): claimed where it arrives."""

    key: str
    task_id: str
    ttl: float


@dataclass(frozen=True, slots=True)
class FreeUnique:
    """Never denies; on grant, ``task_id``'s unique claim of ``key`` is freed
    (``unique_until="started"``)."""

    key: str
    task_id: str


@dataclass(frozen=True, slots=True)
class KeepUnique:
    """Never denies; on grant, ``task_id``'s claim of ``key`` (if it still holds it)
    lives ``ttl`` seconds from now: the run is protected whatever ttl the publish gave
    the claim (a message's ``expires`` bounds its wait in the queue only)."""

    key: str
    task_id: str
    ttl: float


@dataclass(frozen=True, slots=True)
class FairTurn:
    """The turn of ``fair_key`` (a digest) at the shared limit decided by the condition
    just before it (fairness.py); ``key`` is the fairness hash, and three ``FairPart``
    conditions follow with its other keys. ``stride``: how far a grant moves the key's
    pass; ``presence_ms``: how long this worker's presence lasts unrenewed; ``more``:
    this worker holds other requests of the key after this one."""

    key: str
    fair_key: str
    stride: int
    presence_ms: int
    more: bool = False


@dataclass(frozen=True, slots=True)
class FairPart:
    """Another key of the ``FairTurn`` before it (keys only: it decides nothing)."""

    key: str


@dataclass(frozen=True, slots=True)
class StoreGrace:
    """Only in a denial: the store's grace after it lost its data or a replica was
    promoted (the gate adds its key, and the family epoch's, which holds the grace on
    Cluster, when a lease is asked for)."""

    key: str


Condition = (
    TakeLease
    | Rate
    | WeightedRate
    | Penalty
    | Override
    | NotDone
    | SlotNotRun
    | PublishOrder
    | InOrder
    | NotSuperseded
    | NotCancelled
    | ClaimUnique
    | FreeUnique
    | KeepUnique
    | FairTurn
    | FairPart
    | StoreGrace
)


def encode(c: Condition) -> tuple[str, str, str]:
    """What gate.lua reads of condition ``c``: its kind's letter and two values (the
    script's header says what they mean). The one place the letters are written on
    this side; the commonest kinds are matched first (every delivery encodes its plan)."""
    match c:
        case TakeLease():
            return "L", str(c.limit), "1" if c.fence else "0"
        case Override():
            return "O", c.field, ""
        case Rate():
            return "R", str(c.interval_us), str(c.burst)
        case NotDone():
            return "D", attempt_stamp(c.stamp, c.attempt), c.task_id
        case SlotNotRun():
            return "B", str(c.slot), c.task_id
        case KeepUnique():
            return "K", c.task_id, _ms(c.ttl)
        case FreeUnique():
            return "U", c.task_id, ""
        case ClaimUnique():
            return "C", c.task_id, _ms(c.ttl)
        case PublishOrder():
            return "S", "" if c.order is None else str(c.order), c.task_id
        case NotSuperseded():
            return "N", _ms(c.ttl), ""
        case InOrder():
            return "Q", c.place, f"{c.gap_ms} {c.life_ms}"
        case NotCancelled():
            return "X", c.task_id, ""
        case WeightedRate():
            return "W", str(c.increment_us), str(c.tolerance_us)
        case Penalty():
            return "P", "", ""
        case FairTurn():
            return "F", c.fair_key, f"{c.stride} {1 if c.more else 0} {c.presence_ms}"
        case FairPart():
            return "-", "", ""
        case StoreGrace():
            raise ValueError("the store's grace is never asked for: the gate adds it")


def _ms(seconds: float) -> str:
    return str(max(1, round(seconds * 1000)))


def spans_slots(conditions: Sequence[Condition]) -> bool:
    """Whether ``conditions`` name keys of more than one hash tag (a task's own keys and
    a named limit's): on Cluster they cannot be decided in one script call."""
    tags = {hash_tag(c.key) for c in conditions}
    return len(tags) > 1


def slot_groups(conditions: Sequence[Condition]) -> list[list[Condition]]:
    """``conditions`` split by hash tag: the named limits' groups first (sorted, so two
    workers never take them in opposite orders), the task's own keys last. An Override
    stays with the condition it applies to."""
    groups: dict[str, list[Condition]] = {}
    pending: list[Condition] = []
    for c in conditions:
        if isinstance(c, Override):
            pending.append(c)
            continue
        groups.setdefault(hash_tag(c.key), []).extend([*pending, c])
        pending = []
    shared = sorted(
        tag
        for tag, group in groups.items()
        if all(isinstance(c, WeightedRate | Penalty) for c in group)
    )
    own = [tag for tag in groups if tag not in shared]
    return [groups[tag] for tag in [*shared, *own]]
