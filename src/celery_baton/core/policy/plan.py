"""One delivery's plan: the gate conditions a task's policy asks for one call, and
what the run must give back. Celery-free.

Each feature's conditions are asked in a fixed order (gate.lua checks them in order and
a denial names the first that failed): the redelivery guard, the exclusive key (after
its publish order when it supersedes), the concurrency lease, the rates, the named
limits, the unique claim.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from celery_baton.core import fairness
from celery_baton.core.conditions import (
    ClaimUnique,
    FreeUnique,
    InOrder,
    KeepUnique,
    NotDone,
    NotSuperseded,
    Override,
    PublishOrder,
    Rate,
    SlotNotRun,
    TakeLease,
)
from celery_baton.core.gate import HeldClaim, HeldLease
from celery_baton.core.keys import KeyNames, digest
from celery_baton.core.ordered import RECORD_LIFE
from celery_baton.core.policy.model import RatePolicy, RunPlan, TaskPolicy
from celery_baton.core.policy.options import SUPERSEDING
from celery_baton.core.policy.slot_runs import SlotRun
from celery_baton.core.shared_limits import call_cost

MAX_RESERVE = 1.0  # seconds


def plan_delivery(
    policy: TaskPolicy,
    names: KeyNames,
    *,
    task_id: str,
    owner: str,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    celery_rate: float | None = None,
    expires_at: float | None = None,
    redelivered: bool = False,
    now: float | None = None,
    order: int | None = None,
    stamp: str = "",
    attempt: int = 0,
    slot_run: SlotRun | None = None,
    place: str = "",
    unclaimed: bool = False,
) -> RunPlan:
    """The gate conditions of one delivery; raises KeySpecError for bad arguments.

    ``expires_at`` (wall clock, seconds since the epoch; ``now`` by the same clock):
    the message's expiry. Its unique claim may have been given a ttl as short as that
    (see ``publish``), so the run must extend it; and a copy of it that the broker
    gives back after the run was lost with its worker is discarded once expired, so
    the claim is held by the run's liveness (renewed with its leases) rather than
    for ``unique_ttl``: lost with its worker, it lapses within ``lease_ttl`` (or at
    the expiry, if later), and the next publish is queued.
    ``redelivered``: a copy the broker gave back (after a failed ack its claim was kept
    for the redelivery window only, Releasing.unacked_claim_ttl): its run extends it.
    ``order``: a superseding publish's order (its header; None: the gate gives one).
    ``stamp``: the publish this delivery is (``PUBLISH_HEADER``; '': a message sent
    without celery-baton, judged by its task id alone).
    ``attempt``: its Celery ``retries`` (a retry keeps its publish's stamp).
    ``slot_run``: a scheduled beat slot, recorded in its entry's run record.
    ``place``: an ordered call's place in its key's line (its header; '': the gate gives
    one).
    ``unclaimed``: published where the task's options were unknown (headers.
    published_unaware): its unique key was not claimed at the publish; it is claimed here.
    """
    plan = RunPlan(owner, [], [])
    if policy.flow is not None:
        plan.flow_key = policy.flow.store_key(names, policy.name, args, kwargs)
        flow_key = policy.flow.key
        plan.labels[plan.flow_key] = flow_key.material(args, kwargs) if flow_key else ""
    if policy.redelivery_guard:
        _redelivery_guard(policy, plan, names, task_id, stamp, attempt, slot_run)
    if policy.exclusive is not None:
        _exclusive(policy, plan, names, task_id, order, args, kwargs)
    if policy.ordered is not None:
        _ordered(policy, plan, names, place, args, kwargs)
    if policy.concurrency is not None:
        _concurrency(policy, plan, names, args, kwargs)
    rate = policy.rate
    if rate is None and celery_rate is not None:
        rate = RatePolicy(celery_rate, 1, None)
    if rate is not None:
        _rates(policy, plan, names, rate, args, kwargs)
    if policy.shared:
        _shared_limits(policy, plan, names, args, kwargs)
    if policy.unique is not None:
        _unique(policy, plan, names, task_id, expires_at, now, redelivered, unclaimed, args, kwargs)
    return plan


def _redelivery_guard(
    policy: TaskPolicy,
    plan: RunPlan,
    names: KeyNames,
    task_id: str,
    stamp: str,
    attempt: int,
    slot_run: SlotRun | None,
) -> None:
    """Not a copy of a publish that finished (or of an attempt that retried), and no
    other copy of it running."""
    plan.done_key = names.done(policy.name, task_id)
    plan.done_stamp = stamp
    plan.done_attempt = attempt
    plan.conditions.append(NotDone(plan.done_key, stamp, task_id, attempt))
    if slot_run is not None:
        # Recorded in one key per entry, not one per slot (slot_runs.py); the task id's
        # marker above is still read (an older version wrote one per slot).
        plan.done_key = names.slot_runs(policy.name, slot_run.app, slot_run.entry)
        plan.done_link = slot_run.link
        plan.conditions.append(SlotNotRun(plan.done_key, slot_run.slot, task_id))
    plan.run_key = names.lease(policy.name, "run", task_id)
    _lease(policy, plan, plan.run_key, 1, fence=False)


def _exclusive(
    policy: TaskPolicy,
    plan: RunPlan,
    names: KeyNames,
    task_id: str,
    order: int | None,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
) -> None:
    """The exclusive key's lease (fenced), after its publish order when it supersedes."""
    assert policy.exclusive is not None
    material = (
        policy.call_exclusive
        if policy.call_exclusive is not None
        else policy.exclusive.material(args, kwargs)
    )
    key = names.lease(policy.name, "ex", digest(material))
    plan.exclusive_key = key
    plan.labels[key] = material
    if policy.exclusive_conflict in SUPERSEDING:
        # Before the lease: an older publish is superseded whoever holds the key.
        plan.supersede_key = names.supersede(policy.name, digest(material))
        plan.labels[plan.supersede_key] = material
        plan.conditions.append(PublishOrder(plan.supersede_key, order, task_id))
    _lease(policy, plan, key, 1, fence=True)


def _ordered(
    policy: TaskPolicy,
    plan: RunPlan,
    names: KeyNames,
    place: str,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
) -> None:
    """The call's turn in its key's line, then the key's exclusive lease (fenced), which
    the turn's check reads (gate/ordered.lua): the two are adjacent."""
    assert policy.ordered is not None
    material = policy.ordered.material(args, kwargs)
    plan.order_key, key = ordered_keys(policy, names, digest(material))
    plan.order_place = place
    plan.labels[plan.order_key] = material
    plan.conditions.append(
        InOrder(
            plan.order_key,
            place,
            max(1, round(policy.ordered_gap * 1000)),
            round(RECORD_LIFE * 1000),
        )
    )
    plan.exclusive_key = key
    plan.labels[key] = material
    _lease(policy, plan, key, 1, fence=True)


def ordered_keys(policy: TaskPolicy, names: KeyNames, key_digest: str) -> tuple[str, str]:
    """An ordered key's order record and its exclusive lease (``key_digest``: the digest
    of its material, ``TaskPolicy.ordered_key``)."""
    return names.ordered(policy.name, key_digest), names.lease(policy.name, "ex", key_digest)


def _concurrency(
    policy: TaskPolicy,
    plan: RunPlan,
    names: KeyNames,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
) -> None:
    """One of ``limit`` leases of the key (its limit may be overridden at runtime)."""
    assert policy.concurrency is not None
    spec = policy.concurrency.key
    material = spec.material(args, kwargs) if spec else ""
    key = names.lease(policy.name, "cc", digest(material))
    plan.labels[key] = material
    plan.conditions.append(Override(names.limits(policy.name), "concurrency"))
    _lease(policy, plan, key, policy.concurrency.limit, fence=False)
    _fair(policy, plan, names, "cc", key, args, kwargs)


def _rates(
    policy: TaskPolicy,
    plan: RunPlan,
    names: KeyNames,
    rate: RatePolicy,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
) -> None:
    """The task's rate (its limit may be overridden at runtime), and any more rates."""
    # Reserve up to one interval ahead: a waiter that asks early takes its slot
    # and starts exactly then, so wake-up latency costs no rate.
    plan.reserve = min(1.0 / rate.per_second, MAX_RESERVE)
    material = rate.key.material(args, kwargs) if rate.key else ""
    plan.conditions.append(Override(names.limits(policy.name), "rate"))
    plan.conditions.append(
        Rate(names.rate(policy.name, digest(material)), rate.interval_us, rate.burst)
    )
    plan.labels[plan.conditions[-1].key] = material
    _fair(policy, plan, names, "rate", plan.conditions[-1].key, args, kwargs)
    for more in policy.more_rates:
        # Every limit in the same atomic call: all pass or none is spent. Each
        # has a key of its own (its interval in the name), in the task's family.
        plan.reserve = min(plan.reserve, 1.0 / more.per_second)
        plan.conditions.append(
            Rate(
                names.rate(policy.name, f"{digest(material)}:{more.interval_us}"),
                more.interval_us,
                more.burst,
            )
        )
        plan.labels[plan.conditions[-1].key] = material


def _shared_limits(
    policy: TaskPolicy,
    plan: RunPlan,
    names: KeyNames,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
) -> None:
    """Named limits (shared_limits.py builds their conditions). Last: on Cluster they
    are asked first, on their own slots (Gate.decide)."""
    cost = call_cost(policy.cost, policy.shared, args, kwargs)
    for limit in policy.shared:
        ahead = min(limit.increment_us(cost) / 1e6, MAX_RESERVE)
        plan.reserve = min(plan.reserve, ahead) if plan.reserve else ahead
        plan.conditions += limit.conditions(names, cost)
        # A named limit's keys are labelled with its name (worker/events.py).
        plan.labels[names.shared_rate(limit.name)] = limit.name
        plan.labels[names.shared_penalty(limit.name)] = limit.name


def _unique(
    policy: TaskPolicy,
    plan: RunPlan,
    names: KeyNames,
    task_id: str,
    expires_at: float | None,
    now: float | None,
    redelivered: bool,
    unclaimed: bool,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
) -> None:
    """The unique claim: not replaced, then freed at the start or kept for the run; for
    a call whose publish claimed nothing, claimed first (a ``"replace"`` publish's
    order is not known then: such a call is not deduplicated)."""
    plan.unique_key = policy.unique_key(names, args, kwargs)
    if policy.unique_conflict == "replace":
        plan.superseded_key = names.superseded(policy.name, task_id)
        plan.conditions.append(NotSuperseded(plan.superseded_key, policy.unique_ttl))
    elif unclaimed:
        ttl = policy.unique_ttl
        if expires_at is not None:
            claim = HeldClaim(plan.unique_key, task_id, policy.lease_ttl, expires_at)
            plan.kept_claim = claim
            ttl = claim.ttl_from(time.time() if now is None else now)
        plan.conditions.append(ClaimUnique(plan.unique_key, task_id, ttl))
        if policy.unique_until == "started":
            plan.conditions.append(FreeUnique(plan.unique_key, task_id))
        return
    if policy.unique_until == "started":
        plan.conditions.append(FreeUnique(plan.unique_key, task_id))
    elif expires_at is not None:
        # Held while the run lives (renewed with its leases), whatever ttl the
        # publish gave the claim; a task with no other condition makes the call
        # for it.
        claim = HeldClaim(plan.unique_key, task_id, policy.lease_ttl, expires_at)
        plan.kept_claim = claim
        ttl = claim.ttl_from(time.time() if now is None else now)
        plan.conditions.append(KeepUnique(plan.unique_key, task_id, ttl))
    elif plan.conditions or redelivered:
        # Held until the run finishes, in the call made anyway (the claim's ttl
        # from the publish is unique_ttl: no expiry cut it), or made for it.
        plan.conditions.append(KeepUnique(plan.unique_key, task_id, policy.unique_ttl))


def _fair(
    policy: TaskPolicy,
    plan: RunPlan,
    names: KeyNames,
    kind: str,
    limit_key: str,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
) -> None:
    """fair_key: the FairTurn right after the shared limit's own (gate.lua)."""
    if policy.fair is None:
        return
    value, fair_digest = policy.fair.value(args, kwargs)
    base = names.fair(policy.name, kind, limit_key.rsplit(":", 1)[-1])
    plan.conditions += fairness.conditions(base, fair_digest, policy.fair.stride(value))
    plan.fair_queues[limit_key] = f"{limit_key}#{fair_digest}"
    plan.fair_limits[base] = limit_key


def _lease(policy: TaskPolicy, plan: RunPlan, key: str, limit: int, *, fence: bool) -> None:
    plan.conditions.append(TakeLease(key, limit=limit, fence=fence))
    plan.leases.append(HeldLease(key, plan.owner, limit, policy.lease_ttl))
