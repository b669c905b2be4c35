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
beat re-sends it, is skipped too), its grant given back, and it is counted as missed
in its entry's schedule (``beat_missed``: the ``missed`` counter and a history line,
which ``celery baton schedule`` and the web view show). The beat's message says the
policy: ``policy.MISFIRE_HEADER``; triggered runs carry none, and always run.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from celery_baton.core.gate import Decision
from celery_baton.core.policy.headers import BEAT_SLOT_HEADER, MISFIRE_HEADER
from celery_baton.core.policy.slot_runs import beat_base, slot_run
from celery_baton.worker.holding import Delivery
from celery_baton.worker.releasing import Releasing
from celery_baton.worker.verdict import Reason, Skip

logger = logging.getLogger("celery_baton.worker")


@dataclass(frozen=True)
class Late:
    """A held slot admitted late: whether it runs, and why; the later slot it was
    coalesced into (None: not coalesced)."""

    run: bool
    message: str
    into: int | None = None


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
            into=next_ms,
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
        f"time, past its misfire grace ({grace:g}s): {why}"
        + ("" if run else ", recorded as missed"),
    )


def _moment(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).strftime("%H:%M:%S.%f")[:-3]


def follow(
    delivery: Delivery, decision: Decision, releasing: Releasing, *, prefix: str, history: int
) -> Skip | None:
    """For a granted delivery: the Skip of a held beat slot its misfire policy does not
    run (its grant given back, its id recorded as done, counted as missed in its entry
    under the key ``prefix`` with at most ``history`` lines), else None (it starts)."""
    if not delivery.held:
        return None
    request = delivery.request
    at_ms = decision.at_us // 1000
    late = late_slot(request.request_dict, at_ms)
    if late is None:
        return None
    if late.run:
        logger.warning("%s[%s]: %s", request.name, request.id, late.message)
        return None
    # (logged with the skip: outcomes.skip)
    releasing.give_back(delivery.plan, done_ttl=delivery.policy.redelivery_retention)
    record_missed(releasing, request.request_dict, late, at_ms, prefix=prefix, history=history)
    return Skip(Reason.MISFIRE, "", "", late.message)


def record_missed(
    releasing: Releasing, headers: Any, late: Late, at_ms: int, *, prefix: str, history: int
) -> None:
    """Count a held slot that did not run as missed in its entry's schedule, as the beat
    counts the slots it did not send: sent through the gate channel, never waited for.
    A message without its series header (an older beat's) names no app: not counted."""
    run = slot_run(headers)
    if run is None:
        return
    line: dict[str, Any] = {
        "at": at_ms,
        "kind": "missed",
        "count": 1,
        "first": run.slot,
        "last": run.slot,
        "at_worker": True,
    }
    if late.into is not None:
        line.update(coalesced=True, into=late.into)
    base = beat_base(prefix, run.app)
    keys = [f"{base}:entry:{run.entry}", f"{base}:history:{run.entry}"]

    def recorded(reply: Any) -> None:
        if isinstance(reply, BaseException):
            logger.warning("beat slot of %r not counted as missed: %s", run.entry, reply)

    releasing.channel.run("beat_missed", keys, [json.dumps(line), history], recorded)
