"""The gate's conditions: one type per kind, with named fields. Celery-free.

A delivery's plan is a list of these (policy/plan.py, fairness.py, shared_limits.py
build them); the gate script checks them in order and a denial names the first that
failed (``Decision.denied_by``). gate.py writes them for gate.lua, a letter and two
values each, in one place (``gate.encode``); gate.lua's header says what each means
on the store's side.

Every condition has the ``key`` it is decided on: a script's keys must share one Redis
Cluster slot, so the gate groups conditions by the key's hash tag.
"""

from __future__ import annotations

from dataclasses import dataclass


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
    no stamp (a message sent without celery-baton), any finished run of the id."""

    key: str
    stamp: str = ""
    task_id: str = ""


@dataclass(frozen=True, slots=True)
class PublishOrder:
    """Denies a delivery that a newer publish of the same exclusive key superseded
    (``order``: its publish order, None: the gate gives one now); else records it as
    the newest."""

    key: str
    order: int | None
    task_id: str


@dataclass(frozen=True, slots=True)
class NotSuperseded:
    """Denies a delivery that a unique ``replace`` publish superseded; on grant marks it
    started (for ``ttl`` seconds), so a later replace leaves it running."""

    key: str
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
    | PublishOrder
    | NotSuperseded
    | FreeUnique
    | KeepUnique
    | FairTurn
    | FairPart
    | StoreGrace
)
