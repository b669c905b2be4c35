"""Admission's verdict: what a delivery does once the gate answered. Pure logic.

The gate grants all of a delivery's conditions or names the first one that refused
(``Decision.denied_by``). What that means for the delivery depends on which condition
it was and on the task's policy; this module decides it without any worker, store or
clock of its own, so every case has a unit test (tests/unit/worker/test_verdict.py):

* granted: **Start** (holding the leases; a reserved rate slot starts ``start_after``
  seconds from now);
* a copy of a publish of this task id that already finished (the redelivery guard's
  done marker; a message sent without celery-baton: any finished run of its id):
  **Skip**, never run;
* the exclusive key is held by another run and the policy is ``"skip"``: **Skip**, after
  a short grace (the holder's release may be in flight: a caller that waited for the
  first result and publishes again at once must not be skipped);
* a newer publish of the same key reached the gate (``exclusive_conflict="replace"`` or
  ``"keep_last"``), or a unique ``replace`` publish took this one's place: **Skip**;
* the exclusive key is held by an older run and the policy is ``"replace"``: **Wait**,
  asking admission to terminate the holder (``Wait.revoke``), again every
  ``REVOKE_AGAIN`` seconds until its release wakes this delivery;
* an ordered call (``ordered=``) whose turn has not come: **Wait** on its key's lease
  (the release that advances the line wakes it); one whose position was passed: **Skip**
  (skipped by the gap bound: its successors ran; or a copy of a call that ran);
* anything else: **Wait** on the refusing key, for as long as the gate said.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from celery_baton.core.conditions import (
    ClaimUnique,
    FairTurn,
    InOrder,
    NotDone,
    NotSuperseded,
    Penalty,
    PublishOrder,
    Rate,
    SlotNotRun,
    StoreGrace,
    WeightedRate,
)
from celery_baton.core.fairness import REFRESH
from celery_baton.core.gate import Decision, owner_task_id
from celery_baton.core.ordered import Turn
from celery_baton.core.policy.model import RunPlan

#: Seconds a duplicate waits for a release in flight before it is skipped.
SKIP_GRACE = 0.25
#: Seconds between two requests to terminate the run a "replace" delivery waits for (a
#: revoke is a broadcast: one sent while the holder's worker reconnects is lost).
REVOKE_AGAIN = 1.0


class Reason(enum.Enum):
    """Why the gate refused a delivery, in the worker's terms."""

    EXCLUSIVE = "exclusive"  # another run holds the exclusive key
    CONCURRENCY = "concurrency"  # the cap is reached
    RATE = "rate"  # no rate slot yet
    RUNNING_COPY = "running-copy"  # a copy of this very task id runs (redelivery)
    ALREADY_RUN = "already-run"  # this message's run finished (redelivery guard)
    FAIR = "fair"  # a free slot, but other keys of a fair_key limit go first
    PENALTY = "penalty"  # a named limit is penalized (penalize: a 429's Retry-After)
    SUPERSEDED = "superseded"  # a newer publish of the same key replaces this one
    GRACE = "grace"  # the store lost its data: holders re-assert before new grants
    STORE_DOWN = "store-down"  # the store did not answer (not a gate refusal)
    DEBOUNCE = "debounce"  # not quiet yet, or a throttle's trailing run waits its window
    COALESCED = "coalesced"  # a later publish of its debounce/throttle key runs for it
    THROTTLED = "throttled"  # dropped: another run of its key ran within the window
    MISFIRE = "misfire"  # a beat slot held past its misfire grace (worker/misfire.py)
    ORDER = "order"  # an ordered call waits for its turn (core/ordered.py)
    OUT_OF_ORDER = "out-of-order"  # its position was skipped by the gap bound: refused
    DUPLICATE = "duplicate"  # published unclaimed; its unique key is held by another call


@dataclass(frozen=True)
class Start:
    fence: int = 0
    start_after: float = 0.0  # seconds: a reserved rate slot starts later
    epoch: str = ""  # the store epoch the leases were granted under (for renewals)


@dataclass(frozen=True)
class Skip:
    reason: Reason
    key: str
    holder: str  # the task id that holds the key, or that already ran
    message: str


@dataclass(frozen=True)
class Wait:
    reason: Reason
    key: str
    delay: float
    # Jitter spreads workers that one release notice wakes together; a rate wait must
    # not have it: strict GCRA loses every microsecond a waiter comes late.
    jitter: bool = True
    revoke: str = ""  # "replace": the task id whose run must be terminated first
    # A "skip" duplicate's SKIP_GRACE: its verdict comes within a quarter second, and the
    # skip (or start) is the line that says why; the hold is logged at DEBUG only.
    quiet: bool = False


Verdict = Start | Skip | Wait


def reason(decision: Decision, plan: RunPlan) -> Reason:
    """The refusing condition of a denied ``decision``, named."""
    condition = decision.denied_by
    assert condition is not None, "a granted decision has no reason"
    if isinstance(condition, PublishOrder | NotSuperseded):
        return Reason.SUPERSEDED
    if isinstance(condition, InOrder):
        what = Turn.parse(decision.holder).what
        if what == "gap":
            return Reason.OUT_OF_ORDER
        return Reason.ALREADY_RUN if what == "ran" else Reason.ORDER
    if isinstance(condition, NotDone | SlotNotRun):  # a done marker, a beat slot's record
        return Reason.ALREADY_RUN
    if isinstance(condition, ClaimUnique):
        return Reason.DUPLICATE
    if isinstance(condition, Rate | WeightedRate):
        return Reason.RATE
    if isinstance(condition, Penalty):
        return Reason.PENALTY
    if isinstance(condition, StoreGrace):
        return Reason.GRACE
    if isinstance(condition, FairTurn):
        return Reason.FAIR
    if condition.key == plan.exclusive_key:
        return Reason.EXCLUSIVE
    if condition.key == plan.run_key:
        return Reason.RUNNING_COPY
    return Reason.CONCURRENCY


def verdict(
    decision: Decision,
    plan: RunPlan,
    *,
    task_name: str,
    task_id: str,
    conflict: str,
    denied_since: float | None,
    now: float,
    wait_timeout: float | None = None,
) -> Verdict:
    """What the delivery ``task_id`` of ``task_name`` does with the gate's ``decision``.

    ``conflict``: the task's ``exclusive_conflict``; ``denied_since``: when an exclusive
    refusal of this delivery was first seen (None: this is the first), for the grace and
    for ``wait_timeout`` (how long a ``"wait"`` duplicate may wait before it is skipped).
    """
    if decision.granted:
        return Start(decision.fence, decision.start_after, decision.epoch)
    outcome = _verdict(
        decision,
        plan,
        task_name=task_name,
        task_id=task_id,
        conflict=conflict,
        denied_since=denied_since,
        now=now,
        wait_timeout=wait_timeout,
    )
    if isinstance(outcome, Wait) and outcome.key in plan.fair_queues:
        # Waiting for a fair_key limit: ask again in time to renew this worker's
        # presence in the store's queue of waiting keys (fairness.PRESENCE).
        return Wait(outcome.reason, outcome.key, min(outcome.delay, REFRESH), outcome.jitter)
    return outcome


def _verdict(
    decision: Decision,
    plan: RunPlan,
    *,
    task_name: str,
    task_id: str,
    conflict: str,
    denied_since: float | None,
    now: float,
    wait_timeout: float | None,
) -> Verdict:
    why = reason(decision, plan)
    condition = decision.denied_by
    assert condition is not None
    key = condition.key
    holder = decision.holder_task_id
    if isinstance(condition, InOrder):
        return _out_of_turn(why, decision, plan, task_name, task_id)
    if why is Reason.ALREADY_RUN:
        return Skip(
            why,
            key,
            decision.holder,
            f"task id {task_id} already finished; this redelivered copy is not run",
        )
    if why is Reason.DUPLICATE:
        return Skip(
            why,
            key,
            decision.holder,
            f"{task_name} not run: task {decision.holder} with the same unique key is "
            "queued or running (this call was published where the task's options are "
            "unknown, so its key was claimed only as it arrived here)",
        )
    if why is Reason.SUPERSEDED:
        return Skip(
            why,
            key,
            holder,
            f"{task_name}[{task_id}] was superseded by a newer publish, task {holder}; "
            "it is not run",
        )
    # A lease held by a run of this very task id (its own retry, a redelivery while the
    # first copy still runs, or the run a Task.replace() replaces) always waits: it is
    # freed in milliseconds, or that run finishes and this delivery then runs (a new
    # publish) or is refused as already run (a copy of the publish that ran).
    own_copy = owner_task_id(decision.holder) == task_id
    if why is Reason.EXCLUSIVE and conflict == "skip" and not own_copy:
        grace = SKIP_GRACE if denied_since is None else denied_since + SKIP_GRACE - now
        if grace > 0:
            return Wait(why, key, min(grace, max(decision.retry_after, 0.001)), quiet=True)
        label = plan.labels.get(key, "")
        return Skip(
            why,
            key,
            holder,
            f"exclusive key {label or '(task)'} of {task_name} is held by task {holder}; "
            "this run is skipped",
        )
    if why is Reason.EXCLUSIVE and conflict == "replace" and not own_copy:
        # Newer than the holder (the order condition passed): stop it and take its place.
        delay = min(max(decision.retry_after, 0.001), REVOKE_AGAIN)
        return Wait(why, key, delay, revoke=holder)
    waits = conflict in ("wait", "keep_last")
    if why is Reason.EXCLUSIVE and waits and wait_timeout and not own_copy:
        waited = 0.0 if denied_since is None else now - denied_since
        if waited >= wait_timeout:
            label = plan.labels.get(key, "")
            return Skip(
                why,
                key,
                holder,
                f"exclusive key {label or '(task)'} of {task_name} was held by task "
                f"{holder} for the whole wait_timeout ({wait_timeout:g}s); this run is "
                "skipped",
            )
        left = wait_timeout - waited
        return Wait(why, key, min(max(decision.retry_after, 0.0001), left))
    if why is Reason.FAIR:
        # Queued with the shared limit's own key: its release notices wake it.
        limit_key = plan.fair_limits[key]
        rate = any(isinstance(c, Rate) and c.key == limit_key for c in plan.conditions)
        early = decision.retry_after - (plan.reserve * 0.9 if rate else 0.0)
        return Wait(why, limit_key, max(early, 0.0001), jitter=not rate)
    if why is Reason.RATE:
        if plan.reserve:
            # Ask again just inside the reservation window: the slot is then reserved
            # before it comes, however late this worker wakes.
            early = decision.retry_after - plan.reserve * 0.9
            return Wait(why, key, max(early, 0.0001), jitter=False)
        return Wait(why, key, max(decision.retry_after, 0.0001), jitter=False)
    return Wait(why, key, max(decision.retry_after, 0.0001))


def _out_of_turn(
    why: Reason, decision: Decision, plan: RunPlan, task_name: str, task_id: str
) -> Verdict:
    """An ordered call the gate's turn refused (gate/ordered.lua)."""
    condition = decision.denied_by
    assert isinstance(condition, InOrder) and plan.exclusive_key is not None
    label = plan.labels.get(condition.key, "") or "(task)"
    turn = Turn.parse(decision.holder)
    place = condition.place.partition(":")[2] or "?"
    if why is Reason.ORDER:
        # Woken by the key's lease release that advances the line (release.lua); the
        # gate's retry_after is when a lease runs out or the gap bound ends.
        return Wait(why, plan.exclusive_key, max(decision.retry_after, 0.0001))
    if why is Reason.OUT_OF_ORDER:
        return Skip(
            why,
            condition.key,
            "",
            f"{task_name}[{task_id}] came after its successors ran: position {place} of "
            f"ordered key {label} was skipped (it did not come within "
            "ordered_gap_timeout); it is refused, not run out of order",
        )
    return Skip(
        why,
        condition.key,
        task_id,
        f"position {place} of ordered key {label} of {task_name} has run already (the "
        f"next is {turn.next}); this copy of task {task_id} is not run",
    )
