"""Planning: what one delivery asks the gate for, before admission asks.

The policy a delivery runs under is its task's, narrowed by the caller's per-call
options (the ``baton_call`` header) and, for a beat slot, by ``run_once``; Celery's own
``rate_limit`` is read at every ask (``celery control rate_limit`` changes it at run
time). The plan is built under an owner token of its own, so a release can never free
another delivery's grant. No store call here: admission (``worker/admission.py``) asks
the gate with what this returns.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from celery_baton.config import Settings
from celery_baton.core.keys import KeyNames, beat_slot_material
from celery_baton.core.leases import new_owner
from celery_baton.core.policy.headers import (
    BEAT_SLOT_HEADER,
    CALL_HEADER,
    PUBLISH_HEADER,
    published_unaware,
)
from celery_baton.core.policy.model import RunPlan, TaskPolicy
from celery_baton.core.policy.per_call import CallOptions, policy_for_call, run_once
from celery_baton.core.policy.plan import plan_delivery
from celery_baton.core.policy.slot_runs import slot_run
from celery_baton.errors import CostError, KeySpecError
from celery_baton.worker import outcomes
from celery_baton.worker.holding import Delivery
from celery_baton.worker.ordering import place_of
from celery_baton.worker.replacing import order_of


class Planner:
    """A delivery's policy and plan; see the module docstring."""

    def __init__(
        self,
        *,
        policy_for: Callable[[Any], TaskPolicy | None],
        names: KeyNames,
        settings: Settings,
        hostname: str,
    ) -> None:
        self.policy_for = policy_for
        self.names = names
        self.settings = settings
        self.hostname = hostname
        self._celery_rates = outcomes.CeleryRates()
        #: worker_disable_rate_limits: Celery's rate_limit is not this worker's to enforce.
        self.celery_rates_off = False

    def policy(self, request: Any) -> TaskPolicy | None:
        """The policy this delivery runs under (None: nothing to ask, run it as is)."""
        return delivery_policy(
            self.policy_for(request.task), request.task.name, request.request_dict, self.settings
        )

    def celery_rate(self, task: Any) -> float | None:
        # Read at every admission: `celery control rate_limit` changes it on every
        # worker, for any task, also one that had none when the worker started.
        return None if self.celery_rates_off else self._celery_rates.of(task)

    def plan(self, policy: TaskPolicy, request: Any, celery_rate: float | None) -> RunPlan:
        """What this delivery asks for, under an owner token of its own; raises
        KeySpecError (CostError) when its arguments cannot build its keys (its cost)."""
        plan = plan_delivery(
            policy,
            self.names,
            task_id=request.id,
            owner=new_owner(request.id, self.hostname),
            args=request.args,
            kwargs=request.kwargs,
            celery_rate=celery_rate,
            expires_at=request.expires.timestamp() if request.expires else None,
            # A copy redelivered after a failed ack finds its claim kept for the
            # redelivery window only (Releasing.unacked_claim_ttl): its run extends it.
            redelivered=_redelivered(request),
            order=order_of(request),
            stamp=publish_stamp(request),
            attempt=attempt_of(request),
            slot_run=slot_run(request.request_dict),
            place=place_of(request),
            unclaimed=published_unaware(request.request_dict),
        )
        slot = request.request_dict.get(BEAT_SLOT_HEADER)
        if slot is not None and plan.run_key:
            # Its run lease makes a beat slot run once: say so beside it (`locks`), not
            # "redelivery" as if the guard were on.
            entry = request.request_dict.get("baton_beat_entry") or "?"
            plan.labels[plan.run_key] = beat_slot_material(str(entry), slot)
        return plan

    def replan(self, delivery: Delivery) -> bool:
        """A held delivery planned again when `celery control rate_limit` changed its
        task's rate while it was held: it asks with the rate that holds now (lifted, it
        may not need the gate at all: no conditions left). True when it changed."""
        if not delivery.policy.rate_from_celery:
            return False
        rate = self.celery_rate(delivery.request.task)
        if rate == delivery.celery_rate:
            return False
        delivery.celery_rate = rate
        passed = delivery.plan.flow_passed  # a debounce already decided stays so
        with contextlib.suppress(KeySpecError, CostError):  # built once already
            delivery.plan = self.plan(delivery.policy, delivery.request, rate)
        delivery.plan.flow_passed = passed
        return True

    def new_owner(self, request: Any) -> str:
        """A fresh owner token for ``request`` (a new one for every ask that was lost)."""
        return new_owner(request.id, self.hostname)


def publish_stamp(request: Any) -> str:
    """The publish this delivery is (publish.py's header; a copy the broker redelivers
    carries the same), or '' for a message sent without celery-baton, and for a beat
    slot: the beat may send one slot twice (policy/per_call.run_once), and it must run once, so
    the slot is judged by its task id."""
    headers = request.request_dict
    if headers.get(BEAT_SLOT_HEADER) is not None:
        return ""
    stamp = headers.get(PUBLISH_HEADER)
    return stamp if isinstance(stamp, str) else ""


def attempt_of(request: Any) -> int:
    """The delivery's attempt: Celery's ``retries`` header (0: its first run)."""
    retries = request.request_dict.get("retries")
    return retries if isinstance(retries, int) and retries > 0 else 0


def _redelivered(request: Any) -> bool:
    info = getattr(request, "delivery_info", None) or {}
    return bool(info.get("redelivered"))


def delivery_policy(
    policy: TaskPolicy | None, name: str, headers: Any, settings: Settings
) -> TaskPolicy | None:
    """The policy a message of task ``name`` with ``headers`` runs under: the task's
    ``policy`` narrowed by the caller's per-call options and, for a beat slot, by
    ``run_once`` (None: nothing to ask, run it as is)."""
    header = headers.get(CALL_HEADER)
    call = CallOptions.from_header(header) if header is not None else None
    if call is not None:  # the caller's per-call options, for this delivery only
        policy = policy_for_call(policy, name, call, settings)
    if headers.get(BEAT_SLOT_HEADER) is not None:
        # A beat slot may be sent twice (see run_once); it must run once.
        policy = run_once(policy, name, settings)
    return policy
