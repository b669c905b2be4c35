"""Firing what is due: each due entry's slots planned, claimed in the store, published.

A claim (``beat_claim``) is accepted only under the current lease's fence and only if
the entry's stored next slot is still the one this leader expects; it records the
slots' messages in the outbox and advances the next slot atomically. The leader then
publishes them (``outbox.py``).
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Callable
from typing import Any

import redis
from celery.utils.log import get_logger

from celery_baton import metrics
from celery_baton.beat.leader import Leader
from celery_baton.beat.outbox import Outbox, slot_task_id, slot_time
from celery_baton.beat.reload import Entries, StoredSlots
from celery_baton.beat.slots import plan_due
from celery_baton.beat.state import BeatState, Claim
from celery_baton.config import Settings
from celery_baton.store.connection import STORE_ERRORS

logger = get_logger(__name__)

#: What a claim refused by a change in the store means (beat_claim.lua's statuses).
_CLAIM_REFUSED = {
    -1: "its next slot moved",
    -2: "it was removed",
    -3: "its definition changed",
    -4: "it was paused",
}
_READY = frozenset({"SUCCESS", "FAILURE", "REVOKED"})
STORE_FAILURES: tuple[type[BaseException], ...] = (*STORE_ERRORS, redis.RedisError)


class Firing:
    """Plans, claims and publishes the due slots of ``entries``; ``fired`` is called
    with the claims the store accepted, after their slots were published and before
    they leave the outbox."""

    def __init__(
        self,
        app: Any,
        settings: Settings,
        state: BeatState,
        leader: Leader,
        entries: Entries,
        outbox: Outbox,
        fired: Callable[[list[Claim]], None],
    ) -> None:
        self.app = app
        self.settings = settings
        self.state = state
        self.leader = leader
        self.entries = entries
        self.outbox = outbox
        self.fired = fired
        self._overlap_warned = False

    def fire_due(self, now: int) -> None:
        entries, leader = self.entries, self.leader
        claims: list[Claim] = []
        while entries.due and entries.due[0][0] <= now:
            next_ms, name = heapq.heappop(entries.due)
            slots = entries.slots.get(name)
            if slots is None or slots.next_ms != next_ms or slots.paused:
                continue
            claims.append(self._plan(name, slots, now))
        for name in entries.triggers:
            slots = entries.slots.get(name)
            if slots is not None and slots.trigger:
                claims.append(self._plan_trigger(name, slots, now))
        entries.triggers = []
        if not claims:
            return
        pipe = self.state.client.pipeline(transaction=False)
        for claim in claims:
            self.state.claim(leader.owner, leader.fence, claim, self.settings.beat_history, pipe)
        try:
            results = pipe.execute()
        except STORE_FAILURES:
            # Some claims may have been applied: the outbox has them, and the reload
            # after the store is back re-sends them under the same ids.
            entries.dirty = True
            raise
        published: list[str] = []
        accepted: list[Claim] = []
        for claim, result in zip(claims, results, strict=True):
            status = int(result[0])
            if status == 0:
                logger.warning("beat: lost the leader lease while claiming; following")
                leader.lost()
                entries.dirty = True
                break
            if status != 1:
                logger.info(
                    "beat: entry %r changed in the store (%s); reloading",
                    claim.name,
                    _CLAIM_REFUSED.get(status, f"status {status}"),
                )
                entries.dirty = True
                continue
            accepted.append(claim)
            metrics.beat_fired.labels(claim.name).inc(claim.fired)
            metrics.beat_missed.labels(claim.name).inc(claim.missed)
            metrics.beat_suppressed.labels(claim.name).inc(claim.suppressed)
            self._advance(claim)
            for task_id, payload in claim.outbox:
                if self.outbox.publish_slot(claim.name, task_id, json.loads(payload)):
                    published.append(task_id)
        # Recorded before the items leave the outbox: a leader killed in between leaves
        # them to the next one, which re-sends them and records the same slots again
        # (a record that changes nothing: the Django scheduler's row write).
        if accepted:
            self.fired(accepted)
        if published:
            self.state.sent(published)

    def _advance(self, claim: Claim) -> None:
        """Keep what an accepted claim wrote: the next slot, the last one fired."""
        entries = self.entries
        slots = entries.slots[claim.name]
        if claim.new_next is not None:
            entries.claimed[claim.name] = (
                claim.fingerprint,
                claim.new_next,
                claim.last_slot,
                claim.last_id,
            )
            slots.next_ms = claim.new_next
            heapq.heappush(entries.due, (claim.new_next, claim.name))
        else:
            slots.trigger = ""
        if claim.last_id:
            slots.last_id = claim.last_id
        if claim.last_slot is not None:
            slots.last_slot = claim.last_slot

    def _plan(self, name: str, slots: StoredSlots, now: int) -> Claim:
        c = self.entries.compiled[name]
        plan = plan_due(c.rule, slots.next_ms, now, c.policy)
        fire, suppressed = plan.fire, []
        if fire and c.policy.overlap == "skip" and slots.last_id and self._running(slots.last_id):
            fire, suppressed = [], fire
        history: list[str] = []
        missed = len(plan.missed) + plan.missed_beyond
        if missed:
            line: dict[str, Any] = {"at": now, "kind": "missed", "count": missed}
            if plan.missed:
                line.update(first=plan.missed[0], last=plan.missed[-1])
            if plan.coalesced:
                line.update(coalesced=True, into=fire[-1])
            history.append(json.dumps(line))
            self._log_missed(name, plan.missed, missed, fire[-1] if plan.coalesced else None)
        for slot in suppressed:
            history.append(
                json.dumps(
                    {"at": now, "kind": "suppressed", "slot": slot, "running": slots.last_id}
                )
            )
        outbox: list[tuple[str, str]] = []
        before = slots.last_slot
        for slot in fire:
            task_id = self._slot_task_id(name, slot)
            # Each message names the fired slot before it: workers record the slots that
            # ran in one key per entry (policy/slot_runs.py), and a re-send names the same.
            item = {"entry": name, "slot": slot, "kind": "fired", "before": before}
            outbox.append((task_id, json.dumps(item)))
            before = slot
            history.append(json.dumps({"at": now, "kind": "fired", "slot": slot, "id": task_id}))
        return Claim(
            name=name,
            expected_next=slots.next_ms,
            fingerprint=slots.fingerprint,
            new_next=plan.next_slot,
            trigger="",
            last_slot=fire[-1] if fire else None,
            last_id=outbox[-1][0] if outbox else "",
            expected_last=slots.last_slot,
            outbox=outbox,
            history=history,
            fired=len(fire),
            missed=missed,
            suppressed=len(suppressed),
        )

    def _log_missed(self, name: str, slots: list[int], count: int, into: int | None) -> None:
        misfire = self.entries.compiled[name].policy.misfire
        span = f" ({slot_time(slots[0])} .. {slot_time(slots[-1])})" if slots else ""
        if into is None:
            logger.warning(
                "beat: entry %r missed %d slot(s)%s (misfire=%s)", name, count, span, misfire
            )
            return
        logger.warning(
            "beat: entry %r: %d late slot(s)%s coalesced into one run, slot %s; recorded as "
            "missed (misfire=%s; baton_misfire='all' runs each)",
            name,
            count,
            span,
            slot_time(into),
            misfire,
        )

    def _plan_trigger(self, name: str, slots: StoredSlots, now: int) -> Claim:
        slot = int(slots.trigger)
        task_id = self._slot_task_id(name, slot, kind="trigger")
        payload = json.dumps({"entry": name, "slot": slot, "kind": "trigger"})
        line = json.dumps({"at": now, "kind": "triggered", "slot": slot, "id": task_id})
        return Claim(
            name=name,
            expected_next=slots.next_ms,
            fingerprint=slots.fingerprint,
            new_next=None,
            trigger=slots.trigger,
            last_slot=None,
            last_id=task_id,
            expected_last="*",
            outbox=[(task_id, payload)],
            history=[line],
            fired=1,
            missed=0,
            suppressed=0,
        )

    def _slot_task_id(self, name: str, slot: int, kind: str = "fired") -> str:
        return slot_task_id(self.settings.key_prefix, name, slot, kind, app=self.state.keys.app)

    def _running(self, task_id: str) -> bool:
        """Whether the entry's previous run is still queued or running (result backend)."""
        from celery.backends.base import DisabledBackend

        backend = self.app.backend
        if isinstance(backend, DisabledBackend):
            if not self._overlap_warned:
                logger.warning("beat: baton_overlap='skip' needs a result backend; allowing")
                self._overlap_warned = True
            return False
        try:
            state = self.app.AsyncResult(task_id).state
        except Exception as exc:
            logger.warning("beat: cannot read the state of %s (%r); allowing the run", task_id, exc)
            return False
        return state not in _READY
