"""Debounce and throttle in admission: asked before the gate (see debounce.py).

A delivery of a debounced or throttled task first asks its key's decision script. It
runs (then asks the gate for the task's other conditions, if any), waits in holding
(no pool slot) until the store says it may be due, or is skipped: superseded by a
newer publish (its result comes from the run that stands for it) or, for a throttle
in ``"drop"`` mode, dropped within the window (a ``TaskSkipped`` result naming the run).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from celery_baton.core.debounce import FlowDecision, FlowKind, Outcome, parse_decision
from celery_baton.core.gate_channel import GateChannel
from celery_baton.core.keys import KeyNames
from celery_baton.worker.holding import Delivery
from celery_baton.worker.pool.stand_ins import STANDS_FOR_FIELD
from celery_baton.worker.verdict import Reason, Skip, Start, Wait

logger = logging.getLogger("celery_baton.worker")

__all__ = ["FlowDecision", "ask", "outcome"]


def ask(
    channel: GateChannel,
    names: KeyNames,
    delivery: Delivery,
    answered: Callable[[Delivery, Any], None],
) -> None:
    """Ask ``delivery``'s decision script; ``answered`` gets a FlowDecision or an error."""
    policy, plan = delivery.policy.flow, delivery.plan
    assert policy is not None and plan.flow_key is not None
    script, keys, args = policy.decide_call(
        plan.flow_key, delivery.request.id, names.notice_channel
    )

    def on_reply(reply: Any) -> None:
        if not isinstance(reply, BaseException):
            try:
                reply = parse_decision(reply)
            except Exception as exc:  # a reply we cannot read: answer with it, never raise
                reply = exc
        answered(delivery, reply)

    channel.run(script, keys, args, on_reply)


def outcome(delivery: Delivery, decision: FlowDecision) -> Start | Wait | Skip:
    """What ``delivery`` does with its key's decision (marks the plan passed on RUN)."""
    plan, request = delivery.plan, delivery.request
    policy = delivery.policy.flow
    assert policy is not None and plan.flow_key is not None
    key = plan.flow_key
    debounced = policy.kind is FlowKind.DEBOUNCE
    if decision.outcome is Outcome.RUN:
        plan.flow_passed = True
        if decision.stands_for:
            request.request_dict[STANDS_FOR_FIELD] = list(decision.stands_for)
            logger.info(
                "%s[%s] runs for %d superseded: %s",
                request.name,
                request.id,
                len(decision.stands_for),
                ", ".join(decision.stands_for[:5]),
            )
        return Start()
    if decision.outcome is Outcome.WAIT:
        return Wait(Reason.DEBOUNCE, key, max(decision.delay, 0.001), jitter=False)
    holder = decision.holder
    if debounced or policy.mode == "trailing":
        why = "debounced" if debounced else "throttled (trailing)"
        return Skip(
            Reason.COALESCED,
            key,
            holder,
            f"superseded ({why}) by task {holder}: the last publish of the burst runs "
            "for it, and its result will be this one's",
        )
    return Skip(
        Reason.THROTTLED,
        key,
        holder,
        f"throttled: task {holder} ran within the {policy.seconds:g}s window; dropped",
    )
