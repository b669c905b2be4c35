"""A task's compiled policy (``TaskPolicy``) and what one delivery asks under it
(``RunPlan``). Celery-free: compile.py builds the first, plan.py the second.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from celery_baton.core.batch import BatchPolicy
from celery_baton.core.conditions import Condition
from celery_baton.core.debounce import FlowKind, FlowPolicy
from celery_baton.core.fairness import FairPolicy
from celery_baton.core.gate import HeldClaim, HeldLease
from celery_baton.core.keys import KeyNames, KeySpec, digest
from celery_baton.core.policy.options import SUPERSEDING
from celery_baton.core.rates import interval_us
from celery_baton.core.shared_limits import Cost, SharedLimit


@dataclass(frozen=True)
class RatePolicy:
    per_second: float
    burst: int
    key: KeySpec | None

    @property
    def interval_us(self) -> int:
        return interval_us(self.per_second)


@dataclass(frozen=True)
class ConcurrencyPolicy:
    limit: int
    key: KeySpec | None


@dataclass
class RunPlan:
    """What one delivery of a task asks the gate for, and what it must give back."""

    owner: str
    conditions: list[Condition]
    leases: list[HeldLease]
    exclusive_key: str | None = None
    run_key: str | None = None  # the redelivery guard's lease on this task id
    unique_key: str | None = None
    done_key: str | None = None
    done_stamp: str = ""  # the publish this delivery is (PUBLISH_HEADER; '': unstamped)
    done_attempt: int = 0  # its Celery retries: an attempt that retries is recorded too
    done_link: str = ""  # a scheduled beat slot: done_key is its entry's run record
    # The text each key's digest was made of (a named limit's keys: its name), for the
    # operator: `celery baton locks` and the task events say what a request waits for.
    labels: dict[str, str] = field(default_factory=dict)
    supersede_key: str | None = None  # the publish order of a superseding exclusive key
    superseded_key: str | None = None  # this task id's unique replace marker
    reserve: float = 0.0  # seconds ahead a rate slot may be reserved (see gate.lua)
    # Debounce or throttle: decided (flow_key) before the gate; flow_passed once it ran.
    flow_key: str | None = None
    flow_passed: bool = False
    # fair_key: the local wait queue of each shared limit's key (one per fair key
    # value), and the limit key each FairTurn belongs to.
    fair_queues: dict[str, str] = field(default_factory=dict)
    fair_limits: dict[str, str] = field(default_factory=dict)
    kept_claim: HeldClaim | None = None  # the unique claim its run renews (expiring message)
    # ordered=: the key's order record and this call's place ("<epoch>:<position>"; ''
    # until the gate gave an unstamped message one), released with the run's end.
    order_key: str | None = None
    order_place: str = ""

    def with_owner(self, owner: str) -> RunPlan:
        """The same plan for another owner: a new attempt of the same delivery, whose
        earlier owner's grants (if any) are being given back."""
        leases = [dataclasses.replace(lease, owner=owner) for lease in self.leases]
        return dataclasses.replace(self, owner=owner, leases=leases)


@dataclass(frozen=True)
class TaskPolicy:
    """Compiled options of one task. ``plan()`` builds a delivery's conditions."""

    name: str
    lease_ttl: float
    exclusive: KeySpec | None = None
    exclusive_conflict: str = "skip"
    unique: KeySpec | None = None
    unique_until: str = "finished"
    unique_ttl: float = 3600.0
    rate: RatePolicy | None = None
    # More limits decided in the same call: global_rate_limit=["10/s", "500/h"].
    more_rates: tuple[RatePolicy, ...] = ()
    rate_from_celery: bool = False
    concurrency: ConcurrencyPolicy | None = None
    redelivery_guard: bool = False
    redelivery_retention: float = 86400.0
    exclusive_wait_timeout: float | None = None  # a "wait" duplicate skips after this
    unique_conflict: str = "return"  # a duplicate publish: "return" the first, or "raise"
    # Keys given by the call itself (call_options.py): their material, used as given.
    call_exclusive: str | None = None
    call_unique: str | None = None
    fair: FairPolicy | None = None  # fair_key: a shared limit shared fairly
    # Named limits shared with other tasks (baton_limits), and what one call costs them.
    shared: tuple[SharedLimit, ...] = ()
    cost: Cost | None = None
    flow: FlowPolicy | None = None  # debounce or throttle (debounce.py)
    # ordered=: one call of a key at a time, in publish order (core/ordered.py); a missing
    # position holds its key at most ``ordered_gap`` seconds.
    ordered: KeySpec | None = None
    ordered_gap: float = 60.0
    batch: BatchPolicy | None = None  # calls run together by key (core/batch.py)

    @property
    def celery_rate_only(self) -> bool:
        """Whether Celery's runtime ``rate_limit`` is all this task may be gated by: with
        none set, its deliveries skip the gate entirely."""
        return (
            self.rate_from_celery
            and not (self.exclusive or self.concurrency or self.redelivery_guard or self.unique)
            and not self.shared
            and not self.flow
            and not self.ordered
        )

    @property
    def gates_runs(self) -> bool:
        """Whether the worker must pass this task's deliveries through the gate."""
        return bool(
            self.exclusive
            or self.rate
            or self.rate_from_celery
            or self.concurrency
            or self.redelivery_guard
            or self.shared
            or (self.unique and self.unique_until == "started")
            or (self.unique and self.unique_conflict == "replace")
            or self.flow
            or self.ordered
        )

    @property
    def keys_at_publish(self) -> bool:
        """Whether a publish builds a key over the call's arguments (the rest are built
        by the worker alone)."""
        return bool(
            self.unique
            or self.ordered
            or self.batch
            or self.supersedes
            or (self.flow and self.flow.kind is FlowKind.DEBOUNCE)
        )

    @property
    def supersedes(self) -> bool:
        """Whether a newer publish of an exclusive key supersedes an older one."""
        return self.exclusive is not None and self.exclusive_conflict in SUPERSEDING

    def exclusive_digest(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        """The digest naming this call's exclusive key; raises KeySpecError."""
        assert self.exclusive is not None
        if self.call_exclusive is not None:
            return digest(self.call_exclusive)
        return digest(self.exclusive.material(args, kwargs))

    def ordered_key(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[str, str]:
        """The digest naming this call's ordered key, and the text it was made of;
        raises KeySpecError."""
        assert self.ordered is not None
        material = self.ordered.material(args, kwargs)
        return digest(material), material

    def freed_at_end(self, plan: RunPlan) -> str | None:
        """The unique key ``plan``'s run frees when it ends for good (None: it has none,
        or ``unique_until="started"`` freed it at the start)."""
        return plan.unique_key if self.unique_until == "finished" else None

    def unique_key(self, names: KeyNames, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        return self.unique_key_and_material(names, args, kwargs)[0]

    def unique_key_and_material(
        self, names: KeyNames, args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> tuple[str, str]:
        """The unique key and the text its digest was made of (for the key in words)."""
        assert self.unique is not None
        material = (
            self.call_unique if self.call_unique is not None else self.unique.material(args, kwargs)
        )
        return names.unique(self.name, digest(material)), material
