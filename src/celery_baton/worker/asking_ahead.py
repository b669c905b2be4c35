"""Asking ahead: the gate's answer in hand when a pool process frees, within a bound.

A guarded request is asked of the gate only when a pool process can start it
(``worker/pool_slots.py``); the process then idles for a store round trip and a turn of
the consumer's loop, which a drain of short tasks pays at every start (issue 36,
docs/benchmarks.md). So while the pool drains short tasks (slots have come free more
often than every ``AHEAD_BOUND / 2``, the last one less than ``AHEAD_BOUND`` ago), one
request per worker, the first one waiting for a slot, is asked before its slot frees.
Its grant is used only if the slot comes within ``AHEAD_BOUND`` of the ask: the run then
starts at most that long (and its hand-over to the pool process) after the store
granted it. Past the bound the grant is given back (a timer), and the request asks
again when its slot comes, as it would have without this. An answer that comes after
the slot did is used as the answer of an ask made on it.

Plans made of leases (``exclusive``, ``global_concurrency``, the redelivery guard's run
lease) and of ``global_rate_limit`` tokens are asked ahead. A lease is given back whole.
A token is spent when it is granted, for a start then: used within the bound, the run
starts at most that long after its instant (the pool process judges it again at the
body's start, ``worker/pool/rate_grant.py``); unused, it is not given back (a refund
could hand out a token another grant already counted on) but lost, which errs on the
side of the limit, and the request asks again at its slot. Asked ahead it reserves no
later slot (a rate that binds refuses it, and the ask at the slot reserves). A unique
claim freed at the start is freed, a publish order is taken, a fair turn is counted, a
named limit's cost is spent: plans with those keep asking at the free process.
"""

from __future__ import annotations

import math
from collections import deque

from celery_baton.core.conditions import NotDone, Override, Rate, SlotNotRun, TakeLease
from celery_baton.worker.holding import Delivery

#: How long (s) a grant asked ahead may wait for its pool slot; past it, given back.
AHEAD_BOUND = 0.02

#: Conditions that grant leases or rate tokens, or check without writing.
_AHEAD_KINDS = (TakeLease, Rate, Override, NotDone, SlotNotRun)


def eligible(delivery: Delivery) -> bool:
    """Whether ``delivery``'s plan may be asked ahead (see the module docstring)."""
    plan = delivery.plan
    return (
        delivery.policy.flow is None
        and not delivery.policy.rate_from_celery
        and plan.flow_key is None
        and not plan.fair_limits
        and all(type(c) in _AHEAD_KINDS for c in plan.conditions)
    )


class AskingAhead:
    """The deliveries waiting for a pool slot, in order, the one asked ahead, and how
    often slots come free. Used under the holding lock, on the consumer's loop."""

    def __init__(self, bound: float = AHEAD_BOUND) -> None:
        self.bound = bound
        self.waiting: deque[Delivery] = deque()  # waiting for a slot (some stale)
        self.current: Delivery | None = None  # asked ahead: answer due, or grant in hand
        self._last_free = -math.inf
        self._interval = math.inf  # between slots coming free (smoothed)

    def slot_came(self, now: float) -> None:
        if not math.isinf(self._last_free):  # the first one has no interval yet
            gap = min(now - self._last_free, 1.0)
            smoothed = self._interval
            self._interval = gap if math.isinf(smoothed) else 0.8 * smoothed + 0.2 * gap
        self._last_free = now

    def draining(self, now: float) -> bool:
        """Whether slots come free often enough that the next one is due within the bound."""
        return now - self._last_free < self.bound and self._interval < self.bound / 2

    def prune(self, generation: int) -> None:
        """Drop the deliveries at the head that got their slot, or were forgotten."""
        waiting = self.waiting
        while waiting and (not waiting[0].waiting_slot or waiting[0].generation != generation):
            waiting.popleft()

    def candidate(self, generation: int) -> Delivery | None:
        """The first delivery waiting for a slot, if it may be asked ahead now."""
        if self.current is not None:
            return None
        self.prune(generation)
        if not self.waiting:
            return None
        first = self.waiting[0]
        if first.asking or first.asked_ahead or not eligible(first):
            return None
        return first

    def done_with(self, delivery: Delivery) -> None:
        if self.current is delivery:
            self.current = None
