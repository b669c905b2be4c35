"""A beat slot the worker held follows its entry's misfire policy, as the beat would.

The beat fires a slot when it is due, and decides late slots by the entry's misfire
policy (beat/slots.py ``plan_due``). A slot sent on time may then wait in this worker
(the store's grace, an exclusive key, a limit): without a rule of its own, every slot
held meanwhile ran the moment it was admitted, a burst of stale ticks (7 within one
second after a new store's 8 s grace, issues 24 and 35). So a slot the worker held is
treated as the beat treats late slots (the store's clock):

* admitted when a later slot of its entry is already due, it is coalesced into that
  later slot (whose own message runs it): not run, logged as missed, unless
  ``baton_misfire="all"`` (the catch-up);
* admitted more than its entry's misfire grace after its time, ``"skip"`` does not run
  it, ``"latest"`` runs it (no later slot is due), ``"all"`` runs it.

Each decision is logged. A slot that is not run is recorded as done (its copy, if the
beat re-sends it, is skipped too) and its grant given back. The beat's message says the
policy: ``policy.MISFIRE_HEADER``; triggered runs carry none, and always run.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from celery_baton.core.gate import Decision
from celery_baton.core.policy.headers import BEAT_SLOT_HEADER, MISFIRE_HEADER
from celery_baton.worker.holding import Delivery
from celery_baton.worker.releasing import Releasing
from celery_baton.worker.verdict import Reason, Skip

logger = logging.getLogger("celery_baton.worker")


@dataclass(frozen=True)
class Late:
    """A held slot admitted past its misfire grace: whether it runs, and why."""

    run: bool
    message: str


def late_slot(headers: Any, at_ms: int) -> Late | None:
    """What a beat slot admitted at ``at_ms`` (store clock) does; None: on time, or no
    beat slot with a misfire policy."""
    spec = headers.get(MISFIRE_HEADER) if hasattr(headers, "get") else None
    slot = headers.get(BEAT_SLOT_HEADER) if spec is not None else None
    if spec is None or slot is None:
        return None
    try:
        slot_ms, grace = int(slot), float(spec["grace"])
        policy, next_ms = str(spec["misfire"]), int(spec.get("next") or 0)
    except (KeyError, TypeError, ValueError, AttributeError):
        logger.warning("beat slot with an unreadable %s header %r: run", MISFIRE_HEADER, spec)
        return None
    late_ms = at_ms - slot_ms
    entry = headers.get("baton_beat_entry", "?")
    moment = _moment(slot_ms)
    if policy != "all" and 0 < next_ms <= at_ms:
        return Late(
            False,
            f"beat slot {moment}Z of entry {entry!r} admitted {late_ms / 1000:.1f}s after its "
            f"time, when its next slot {_moment(next_ms)}Z is due: coalesced into the later "
            f"slot, recorded as missed (baton_misfire={policy!r}; 'all' runs each)",
        )
    if late_ms <= grace * 1000:
        return None
    if policy == "all":
        run, why = True, "runs (baton_misfire='all')"
    elif policy == "latest":
        run, why = True, "runs, the entry's latest slot (baton_misfire='latest')"
    else:
        run, why = False, "skipped (baton_misfire='skip')"
    return Late(
        run,
        f"beat slot {moment}Z of entry {entry!r} admitted {late_ms / 1000:.1f}s after its "
        f"time, past its misfire grace ({grace:g}s): {why}",
    )


def _moment(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).strftime("%H:%M:%S.%f")[:-3]


def follow(delivery: Delivery, decision: Decision, releasing: Releasing) -> Skip | None:
    """For a granted delivery: the Skip of a held beat slot its misfire policy does not
    run (its grant given back, its id recorded as done), else None (it starts)."""
    if not delivery.held:
        return None
    request = delivery.request
    late = late_slot(request.request_dict, decision.at_us // 1000)
    if late is None:
        return None
    if late.run:
        logger.warning("%s[%s]: %s", request.name, request.id, late.message)
        return None
    # (logged with the skip: outcomes.skip)
    releasing.give_back(delivery.plan, done_ttl=delivery.policy.redelivery_retention)
    return Skip(Reason.MISFIRE, "", "", late.message)
