"""Ordered calls (``ordered=``) on the worker side: the place a delivery asks with, the
order of its key's waiters here, what the gate said besides, and what its end tells the
line. The order itself is decided by the gate (gate/ordered.lua) and advanced by the
release (release.lua); core/ordered.py tells the whole story.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
from typing import Any

from celery_baton.core.conditions import InOrder
from celery_baton.core.gate import Decision, Release
from celery_baton.core.keys import KeyNames
from celery_baton.core.ordered import Note, Place, positions
from celery_baton.core.policy.headers import ORDERED_HEADER
from celery_baton.core.policy.model import RunPlan, TaskPolicy
from celery_baton.core.policy.plan import ordered_keys

logger = logging.getLogger("celery_baton.worker")

#: Where a run that retried keeps the seconds until its retry is due (request.py).
RETRY_IN_ATTR = "_baton_retry_in"


def place_of(request: Any) -> str:
    """The delivery's place in its ordered key's line ('' : none, or unreadable)."""
    place = Place.parse(request.request_dict.get(ORDERED_HEADER))
    return place.header() if place is not None else ""


def rank(request: Any) -> float | None:
    """An ordered delivery's rank in its key's wait queue here: the earlier position
    first (only a queue's head asks the gate, so a later position at the head would keep
    the one whose turn it is from asking). None: not an ordered delivery."""
    place = Place.parse(request.request_dict.get(ORDERED_HEADER))
    return None if place is None else -float(place.position)


def is_ordered(request: Any) -> bool:
    """Whether ``request`` is an ordered call with its place (its rank is its position)."""
    return Place.parse(request.request_dict.get(ORDERED_HEADER)) is not None


def follow_note(request: Any, plan: RunPlan, decision: Decision) -> None:
    """What the gate's turn did besides passing or refusing: a place given to an
    unstamped message (kept for its later asks and its end), positions skipped by the
    gap bound (said: the calls there are refused if they come), a record that was lost."""
    if not decision.note or plan.order_key is None:
        return
    note = Note.parse(decision.note)
    label = plan.labels.get(plan.order_key, "") or "(task)"
    if note.assigned is not None:
        place = note.assigned.header()
        request.request_dict[ORDERED_HEADER] = place
        plan.order_place = place
        plan.conditions = [
            dataclasses.replace(c, place=place) if isinstance(c, InOrder) else c
            for c in plan.conditions
        ]
        logger.info(
            "%s[%s] was sent without a place in ordered key %s: given position %d on arrival",
            request.name,
            request.id,
            label,
            note.assigned.position,
        )
    if note.skipped is not None:
        # Said by the worker whose ask made the skip (once: the store wrote it then).
        logger.warning(
            "baton: ordered key %s of %s skipped position %s: its call did not come within "
            "ordered_gap_timeout (expired, revoked or lost before a worker took it); "
            "position %d runs next, and a skipped call is refused if it comes",
            label,
            request.name,
            positions(note.skipped),
            note.skipped[1] + 1,
        )
    if note.lost and decision.granted:
        logger.warning(
            "baton: %s[%s] of ordered key %s was placed under an order record the store "
            "no longer has (restarted without its data, or expired): it runs in arrival "
            "order, one at a time",
            request.name,
            request.id,
            label,
        )


def retry_in(exc: Any) -> float:
    """Seconds until a retry (Celery's ``Retry``) is due: its countdown or eta."""
    when = getattr(exc, "when", None)
    if isinstance(when, int | float) and not isinstance(when, bool):
        return max(0.0, float(when))
    if isinstance(when, datetime.datetime):
        now = datetime.datetime.now(when.tzinfo or datetime.timezone.utc)
        if when.tzinfo is None:
            now = now.replace(tzinfo=None)
        return max(0.0, (when - now).total_seconds())
    return 0.0


def end_place(plan: RunPlan) -> str:
    """``"<epoch> <position>"`` of an ordered run, for its end's record ('' : none)."""
    place = Place.parse(plan.order_place)
    if plan.order_key is None or place is None or plan.exclusive_key is None:
        return ""
    return f"{place.epoch} {place.position}"


def passed(plan: RunPlan) -> Release | None:
    """The release that passes an ordered call's turn without a run (it was skipped,
    revoked or cancelled): its position is given up, now if it is next, else when the
    line reaches it (release.lua). None: not an ordered call with a place."""
    place = Place.parse(plan.order_place)
    if plan.order_key is None or place is None or plan.exclusive_key is None:
        return None
    return _given_up(plan.owner, place, plan.order_key, plan.exclusive_key)


def passed_unadmitted(
    policy: TaskPolicy, names: KeyNames, context: Any, owner: str
) -> Release | None:
    """The release that passes the turn of an ordered call Celery dropped before it
    was admitted (revoked or expired as it was received: Celery's ``task_revoked``
    signal, ``context`` its request context); its key waited out the gap bound before.
    Given up again for a call that was admitted and passed already, it moves nothing
    (release.lua: a position passed is not passed twice). Raises KeySpecError."""
    place = Place.parse(getattr(context, ORDERED_HEADER, None))
    if policy.ordered is None or place is None:
        return None
    digest, _ = policy.ordered_key(context.args or (), context.kwargs or {})
    return _given_up(owner, place, *ordered_keys(policy, names, digest))


def _given_up(owner: str, place: Place, order_key: str, order_lease: str) -> Release:
    """The release giving up ``place`` in its key's line (release.lua, end "2")."""
    return Release(
        (),
        owner,
        order=f"{place.epoch} {place.position} 2 0",
        order_key=order_key,
        order_lease=order_lease,
    )


def with_end(release: Release, request: Any, plan: RunPlan, *, final: bool) -> Release:
    """``release`` with what the run's end tells its key's line: final, the next
    position's turn; else (a retry, a message that comes back) it keeps its place, its
    gap clock restarting when a retry is due."""
    place = Place.parse(plan.order_place)
    if plan.order_key is None or place is None or plan.exclusive_key is None:
        return release
    hold_ms = 0
    if not final:
        hold_ms = round(float(getattr(request, "__dict__", {}).get(RETRY_IN_ATTR, 0.0)) * 1000)
    return dataclasses.replace(
        release,
        order=f"{place.epoch} {place.position} {1 if final else 0} {hold_ms}",
        order_key=plan.order_key,
        order_lease=plan.exclusive_key,
    )
