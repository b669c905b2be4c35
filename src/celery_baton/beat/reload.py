"""The leader's copy of the schedule, and the reload that keeps it in step.

Entries come from ``beat_schedule`` (compiled once, at start) and from the store (the
runtime API's, compiled at each reload). A reload reads every stored entry, defines
the configured ones that are new or edited (an edit of *when* moves the next slot to
the first one after now), removes the configured ones gone from the configuration,
writes back the claims of this process that the store lost, and lists each entry's
next slot for firing. It runs when this process begins to lead, and after any change
in the store (the version key moved, or a claim was refused).
"""

from __future__ import annotations

import heapq
import json
from dataclasses import dataclass
from typing import Any

from celery.schedules import crontab
from celery.utils.log import get_logger

from celery_baton.beat.entries import CompiledEntry, compile_entry, entry_from_definition
from celery_baton.beat.leader import Leader
from celery_baton.beat.outbox import slot_time
from celery_baton.beat.state import BeatState, Claim
from celery_baton.config import Settings
from celery_baton.errors import BatonError

logger = get_logger(__name__)


@dataclass
class StoredSlots:
    """The leader's copy of one entry's stored state."""

    next_ms: int
    fingerprint: str
    paused: bool
    trigger: str
    last_id: str
    last_slot: int | None = None  # the last fired slot: the one before the next fired


class Entries:
    """The entries the leader fires: compiled, with their stored slots.

    ``dirty``: the copy is to be read again before firing; ``full_sync``: every entry
    is to be defined again (this process just began to lead).
    """

    def __init__(
        self, app: Any, settings: Settings, state: BeatState, leader: Leader, entry_class: Any
    ) -> None:
        self.app = app
        self.settings = settings
        self.state = state
        self.leader = leader
        self.entry_class = entry_class
        # Changed in place, never replaced: the outbox reads this same dict.
        self.compiled: dict[str, CompiledEntry] = {}
        self.config_names: set[str] = set()
        self.refused: dict[str, str] = {}
        self._refused_stored: dict[str, str] = {}
        self.slots: dict[str, StoredSlots] = {}
        self.due: list[tuple[int, str]] = []  # heap of (next slot, entry); stale items too
        self.triggers: list[str] = []
        # What this process claimed last, per entry: (fingerprint, next slot after the
        # claim, last slot fired, its task id); see _restore_lost_claims.
        self.claimed: dict[str, tuple[str, int, int | None, str]] = {}
        self.version = -1
        self.dirty = True
        self.full_sync = True

    # -- compiling -----------------------------------------------------------------

    def compile_config(self) -> None:
        """Compile ``beat_schedule`` (with Celery's ``celery.backend_cleanup``)."""
        config: dict[str, Any] = dict(self.app.conf.beat_schedule or {})
        if (
            self.app.conf.result_expires
            and not self.app.backend.supports_autoexpire
            and "celery.backend_cleanup" not in config
        ):
            config["celery.backend_cleanup"] = {
                "task": "celery.backend_cleanup",
                "schedule": crontab("0", "4", "*"),
                "options": {"expires": 12 * 3600},
            }
        for name, spec in config.items():
            try:
                entry = self.entry_class(**dict(spec, name=name, app=self.app))
                compiled = compile_entry(entry, settings=self.settings, app=self.app)
            except BatonError as exc:
                self.refuse(name, str(exc))
                continue
            except Exception as exc:
                self.refuse(name, f"beat entry {name!r}: {exc!r}")
                continue
            self.compiled[name] = compiled
            self.config_names.add(name)

    def refuse(self, name: str, reason: str) -> None:
        if self.refused.get(name) != reason:
            logger.error("beat: refusing %s; the other entries keep running", reason)
        self.refused[name] = reason

    def _compile_api(self, name: str, definition: str) -> None:
        try:
            entry = entry_from_definition(name, definition, self.app)
            self.compiled[name] = compile_entry(
                entry, settings=self.settings, app=self.app, source="api", definition=definition
            )
            self.refused.pop(name, None)
        except BatonError as exc:
            self.refuse(name, str(exc))
        except Exception as exc:
            self.refuse(name, f"beat entry {name!r}: {exc!r}")

    # -- reading the store ---------------------------------------------------------

    def next_ms(self) -> int | None:
        """The earliest next slot of an entry that fires (stale heap items dropped)."""
        while self.due:
            next_ms, name = self.due[0]
            slots = self.slots.get(name)
            if slots is None or slots.next_ms != next_ms or slots.paused:
                heapq.heappop(self.due)  # stale heap item
                continue
            return next_ms
        return None

    def reload(self) -> bool:
        """Read every entry from the store; define config entries that are new or
        edited. False when it turned out this process does not lead."""
        beat, leader = self.state, self.leader
        now = leader.now_ms()
        version = int(beat.client.get(beat.keys.version) or 0)
        stored = beat.load()
        full = self.full_sync
        for name in list(self.compiled):
            if name not in self.config_names:
                del self.compiled[name]  # API entries are rebuilt from the store below
        for name, fields in stored.items():
            if fields.get("source") == "api" and name not in self.config_names:
                self._compile_api(name, fields.get("def", ""))
        pipe = beat.client.pipeline(transaction=False)
        defined: list[str] = []
        for name, c in self.compiled.items():
            fields = stored.get(name, {})
            if (
                full
                or fields.get("fp") != c.fingerprint
                or not fields.get("next")
                or fields.get("source") != c.source
            ):
                if fields.get("source") == "api" and c.source == "config":
                    logger.warning("beat: beat_schedule entry %r replaces an API entry", name)
                beat.define(
                    owner=leader.owner,
                    fence=leader.fence,
                    mode="sync",
                    name=name,
                    fingerprint=c.fingerprint,
                    next_slot=c.rule.first_after(now),
                    edited_line=json.dumps({"at": now, "kind": "edited"}),
                    history_max=self.settings.beat_history,
                    fields=c.fields(),
                    pipe=pipe,
                )
                defined.append(name)
        own = beat.keys.app
        stale = [
            n
            for n, f in stored.items()
            if n not in self.compiled and f.get("source") != "api" and f.get("app", own) == own
        ]
        for name in stale:
            beat.remove(
                owner=leader.owner, fence=leader.fence, name=name, source="config", pipe=pipe
            )
        results = pipe.execute()
        for name, result in zip(defined, results[: len(defined)], strict=True):
            if int(result[0]) == 0:
                leader.lost()
                return False
            stored.setdefault(name, {})
            stored[name]["next"] = str(result[1])
            stored[name]["fp"] = self.compiled[name].fingerprint
        for name, status in zip(stale, results[len(defined) :], strict=True):
            if int(status) == 1:
                gone = (
                    "django-celery-beat's enabled rows"
                    if stored[name].get("source") == "django"
                    else "beat_schedule"
                )
                logger.info("beat: entry %r is gone from %s; removed it", name, gone)
            elif int(status) == -4:
                logger.warning("beat: entry %r belongs to another app; left alone", name)
            stored.pop(name, None)
        if not self._restore_lost_claims(stored, now):
            return False
        if full or self.refused != self._refused_stored:
            beat.set_refused(self.refused)
            self._refused_stored = dict(self.refused)
        self._copy(stored)
        self.version = version
        self.dirty = self.full_sync = False
        return True

    def _copy(self, stored: dict[str, dict[str, str]]) -> None:
        """Keep each entry's stored slots, and the heap of next slots to fire."""
        self.slots = {}
        self.triggers = []
        for name, c in self.compiled.items():
            fields = stored.get(name, {})
            if not fields.get("next"):
                continue
            slots = StoredSlots(
                next_ms=int(fields["next"]),
                fingerprint=c.fingerprint,
                paused=fields.get("paused") == "1",
                trigger=fields.get("trigger", ""),
                last_id=fields.get("last_id", ""),
                last_slot=int(fields["last_slot"]) if fields.get("last_slot") else None,
            )
            self.slots[name] = slots
            if slots.trigger:
                self.triggers.append(name)
        self.due = [(s.next_ms, n) for n, s in self.slots.items() if not s.paused]
        heapq.heapify(self.due)

    def _restore_lost_claims(self, stored: dict[str, dict[str, str]], now: int) -> bool:
        """Write back the claims of this process that the store lost; False when it
        turned out not to lead.

        An entry's stored next slot behind the one this process claimed, under the same
        definition, is moved back by nothing but lost writes: a master change to a
        replica that was behind, or, after a planned Sentinel failover, a claim taken by
        the old master in the moment before the switch was seen (it is writable until a
        sentinel reconfigures it). The slots in between were published by this process,
        and may have run already, their workers' done markers lost with the claim;
        claiming them again would send them again (docs/failure.md). So the next slot
        is written back, firing nothing. (Another beat that leads then has no such
        memory: it claims those slots again.)
        """
        restores = []
        for name, (fingerprint, mine, last_slot, last_id) in self.claimed.items():
            fields = stored.get(name)
            if not fields or fields.get("fp") != fingerprint or fields.get("paused") == "1":
                continue
            found = fields.get("next", "")
            if not found or int(found) >= mine:
                continue
            line = {"at": now, "kind": "restored", "from": int(found), "next": mine}
            restores.append(
                Claim(
                    name=name,
                    expected_next=int(found),
                    fingerprint=fingerprint,
                    new_next=mine,
                    trigger="",
                    last_slot=last_slot,
                    last_id=last_id,
                    expected_last="*",
                    outbox=[],
                    history=[json.dumps(line)],
                    fired=0,
                    missed=0,
                    suppressed=0,
                )
            )
        if not restores:
            return True
        beat, leader = self.state, self.leader
        pipe = beat.client.pipeline(transaction=False)
        for claim in restores:
            beat.claim(leader.owner, leader.fence, claim, self.settings.beat_history, pipe)
        for claim, result in zip(restores, pipe.execute(), strict=True):
            status = int(result[0])
            if status == 0:
                leader.lost()
                return False
            if status == 1:
                logger.warning(
                    "beat: the store lost entry %r's claims from slot %s (a master change "
                    "to a replica that was behind?); wrote them back: this beat sent those "
                    "slots already, next slot %s",
                    claim.name,
                    slot_time(claim.expected_next),
                    slot_time(claim.new_next),
                )
                stored[claim.name]["next"] = str(claim.new_next)
                if claim.last_slot is not None:
                    stored[claim.name]["last_slot"] = str(claim.last_slot)
                if claim.last_id:
                    stored[claim.name]["last_id"] = claim.last_id
        return True
