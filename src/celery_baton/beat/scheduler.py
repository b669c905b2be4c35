"""``celery_baton.beat:Scheduler``: Celery beat that fires each slot exactly once.

Any number of ``celery beat -S celery_baton.beat:Scheduler`` processes may run. Each
tick every process calls ``beat_lead``; one holds the leader lease (ttl
``baton_beat_lease_ttl``, renewed every ttl/3) and only it fires. The race this
prevents, step by step:

1. Beats A and B both think an entry's slot 10:00 is due (B just took over after A
   stalled, or both run with the same config).
2. Each calls ``beat_claim`` with the slot it expects (10:00) and its fence. The
   script accepts only the current lease's owner and fence, and only if the stored
   next slot is still 10:00; it then records the slot in the outbox and advances the
   next slot to 10:01, atomically. The other call fails and its beat reloads.
3. The winner publishes under task id ``uuid5(app, entry, slot)`` and clears the outbox
   item. Killed between 2 and 3, the next leader finds the item in the outbox and
   publishes it under the same id.
4. A broker cannot be fenced: a leader blocked in its publish past its lease still
   sends when the broker comes back, after the next leader re-sent the slot. So the
   message carries the slot (header ``baton_beat_slot``) and a worker with celery-baton
   admits a slot's task id once (``policy/per_call.run_once``): sent twice, it runs once.

Each app (``app.main``) has its own leader, entries and outbox (see ``state``): two
projects on one store never follow or remove each other's schedule.

Time: slots are epoch milliseconds (UTC). "Now" is the store server's clock, read at
each ``beat_lead`` and advanced with the monotonic clock in between, so all beats
agree, and a jump of the host's wall clock causes neither a burst nor a stall.
"""

from __future__ import annotations

import heapq
import json
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import celery.beat
import redis
from celery.beat import BeatLazyFunc, ScheduleEntry
from celery.schedules import crontab
from celery.utils.log import get_logger

from celery_baton import metrics
from celery_baton.beat.entries import CompiledEntry, compile_entry, entry_from_definition
from celery_baton.beat.slots import plan_due
from celery_baton.beat.state import BeatState, Claim, schedule_name
from celery_baton.config import Settings
from celery_baton.core.policy.headers import BEAT_SLOT_HEADER, MISFIRE_HEADER, SERIES_HEADER
from celery_baton.core.policy.slot_runs import SlotRun
from celery_baton.errors import BatonError, ConfigError
from celery_baton.parts import parts_for
from celery_baton.store.connection import STORE_ERRORS, Store

logger = get_logger(__name__)

#: What a claim refused by a change in the store means (beat_claim.lua's statuses).
_CLAIM_REFUSED = {
    -1: "its next slot moved",
    -2: "it was removed",
    -3: "its definition changed",
    -4: "it was paused",
}

#: Namespace of the task ids derived from (key prefix, app, entry, slot).
SLOT_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "celery-baton:beat:slot")
_READY = frozenset({"SUCCESS", "FAILURE", "REVOKED"})
_STORE_FAILURES: tuple[type[BaseException], ...] = (*STORE_ERRORS, redis.RedisError)


def slot_task_id(
    prefix: str, entry: str, slot_ms: int, kind: str = "fired", *, app: str = ""
) -> str:
    """The task id of ``entry``'s message for ``slot_ms``: the same in every beat of the
    app named ``app`` (its ``schedule_name``), different in another app, whose entry of
    the same name must not be taken for this one's (a worker runs a slot's id once)."""
    tag = "" if kind == "fired" else f"|{kind}"
    scope = f"{prefix}|{app}" if app else prefix
    return str(uuid.uuid5(SLOT_NAMESPACE, f"{scope}|{entry}|{slot_ms}{tag}"))


@dataclass
class StoredSlots:
    """The leader's copy of one entry's stored state."""

    next_ms: int
    fingerprint: str
    paused: bool
    trigger: str
    last_id: str
    last_slot: int | None = None  # the last fired slot: the one before the next fired


def slot_time(slot_ms: Any) -> str:
    """A slot (epoch milliseconds) as a UTC time for logs: 2026-06-01T09:00:00.000Z."""
    try:
        moment = datetime.fromtimestamp(int(slot_ms) / 1000, tz=timezone.utc)
    except (TypeError, ValueError, OverflowError):
        return str(slot_ms)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


class Scheduler(celery.beat.Scheduler):  # type: ignore[misc]
    """Celery beat scheduler keeping its state in the store; see the module docstring.

    >>> app.conf.beat_scheduler = "celery_baton.beat:Scheduler"  # doctest: +SKIP

    ``clock`` (epoch milliseconds) replaces the store's clock: for tests only.
    """

    def __init__(
        self,
        app: Any,
        *args: Any,
        clock: Callable[[], int] | None = None,
        store: Store | None = None,
        **kwargs: Any,
    ) -> None:
        self.parts = parts_for(app)
        try:
            self.settings: Settings = self.parts.settings
        except ConfigError as exc:
            # One line naming the setting, not a traceback through Celery's beat.
            raise SystemExit(f"celery_baton.errors.{type(exc).__name__}: {exc}") from None
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._clock = clock
        self._store = store
        self._owns_store = store is None
        self._beat: BeatState | None = None
        self._compiled: dict[str, CompiledEntry] = {}
        self._config_names: set[str] = set()
        self._refused: dict[str, str] = {}
        self._refused_stored: dict[str, str] = {}
        self._slots: dict[str, StoredSlots] = {}
        self._due: list[tuple[int, str]] = []
        self._triggers: list[str] = []
        # What this process claimed last, per entry: (fingerprint, next slot after the
        # claim, last slot fired, its task id); see _restore_lost_claims.
        self._claimed: dict[str, tuple[str, int, int | None, str]] = {}
        self._leading = False
        self._standing_by_for: str | None = None
        self._fence = 0
        self._version = -1
        self._dirty = True
        self._full_sync = True
        self._renew_at = 0.0
        self._lease_until = 0.0
        self._outbox_at = 0.0
        self._anchor: tuple[int, float] | None = None
        self._store_error_logged = 0.0
        self._overlap_warned = False
        super().__init__(app, *args, **kwargs)

    # -- Celery's Scheduler interface -----------------------------------------------

    @property
    def ttl(self) -> float:
        return self.settings.beat_lease_ttl

    def setup_schedule(self) -> None:
        if self._store is None:
            self._store = self.parts.connect(
                socket_timeout=min(self.settings.socket_timeout, self.ttl / 3),
                client_name="baton-beat",
            )
        self._beat = BeatState(self._store, self.settings.key_prefix, schedule_name(self.app.main))
        metrics.serve(self.settings.metrics_port)
        self._compile_config()

    def get_schedule(self) -> dict[str, ScheduleEntry]:
        return {name: c.entry for name, c in self._compiled.items()}

    def set_schedule(self, schedule: Any) -> None:
        # The schedule lives in the store; Celery's base class never needs to set it.
        pass

    schedule = property(get_schedule, set_schedule)

    def sync(self) -> None:
        # Every change is written to the store when it happens; nothing to flush.
        pass

    def close(self) -> None:
        """Resign the lease at once (SIGTERM), so a follower leads on its next poll."""
        try:
            if self._leading and self._beat is not None:
                self._beat.resign(self.owner)
                logger.info("beat: resigned the leader lease (fence %s)", self._fence)
        except _STORE_FAILURES as exc:
            logger.warning("beat: could not resign the leader lease: %r", exc)
        finally:
            self._leading = False
            try:
                super().close()
            finally:
                if self._owns_store and self._store is not None:
                    self._store.client.close()

    @property
    def info(self) -> str:
        url = self._store.safe_url if self._store else (self.settings.url or "embedded://")
        return f"    . store -> {url} (leader lease {self.ttl:g} s)"

    def tick(self, *args: Any, **kwargs: Any) -> float:
        """One pass: renew or take the lease, fire what is due; returns seconds to sleep."""
        try:
            return self._tick()
        except _STORE_FAILURES as exc:
            self._store_failed(exc)
        except Exception:
            logger.exception("beat: tick failed; trying again in 1 s")
            self._dirty = True
        return 1.0

    # -- the loop --------------------------------------------------------------------

    def now_ms(self) -> int:
        """Now, in epoch milliseconds, by the store's clock (or the injected one)."""
        if self._clock is not None:
            return int(self._clock())
        if self._anchor is None:
            return int(time.time() * 1000)
        server_ms, mono = self._anchor
        return server_ms + int((time.monotonic() - mono) * 1000)

    @property
    def leading(self) -> bool:
        return self._leading

    def _tick(self) -> float:
        mono = time.monotonic()
        if mono >= self._renew_at:
            self._lead(mono)
        elif self._leading and mono > self._lease_until:
            self._leading = False
        if not self._leading:
            return max(self._renew_at - time.monotonic(), 0.05)
        if self._dirty:
            self._reload()
            if not self._leading:
                return max(self._renew_at - time.monotonic(), 0.05)
        self._fire_due(self.now_ms())
        if time.monotonic() >= self._outbox_at:
            self._resend_outbox()
        return self._delay()

    def _delay(self) -> float:
        mono = time.monotonic()
        delay = min(self._renew_at - mono, float(self.max_interval))
        while self._due:
            next_ms, name = self._due[0]
            slots = self._slots.get(name)
            if slots is None or slots.next_ms != next_ms or slots.paused:
                heapq.heappop(self._due)  # stale heap item
                continue
            delay = min(delay, (next_ms - self.now_ms()) / 1000)
            break
        return max(delay, 0.0)

    def _lead(self, mono: float) -> None:
        assert self._beat is not None
        reply = self._beat.lead(self.owner, int(self.ttl * 1000))
        after = time.monotonic()
        self._anchor = (reply.server_ms, (mono + after) / 2)
        self._renew_at = mono + self.ttl / 3
        if reply.leading:
            if not self._leading or reply.fence != self._fence:
                logger.info("beat: leading the schedule (fence %s)", reply.fence)
                metrics.beat_leader_changes.inc()
                self._full_sync = self._dirty = True
            self._leading = True
            self._fence = reply.fence
            # Measured from before the call: the server's lease may have started then.
            self._lease_until = mono + self.ttl
            if reply.version != self._version:
                self._dirty = True
        else:
            if self._leading:
                logger.warning("beat: lost the leader lease to %s", reply.holder)
            elif reply.holder != self._standing_by_for:
                logger.info("beat: standing by; %s leads", reply.holder or "nobody yet")
            self._standing_by_for = reply.holder
            self._leading = False

    def _store_failed(self, exc: BaseException) -> None:
        mono = time.monotonic()
        if mono - self._store_error_logged > 10:
            logger.warning("beat: store unavailable, firing nothing until it is back: %r", exc)
            self._store_error_logged = mono
        self._dirty = True
        self._renew_at = min(self._renew_at, mono + 1.0)
        if self._leading and mono > self._lease_until:
            self._leading = False

    # -- loading and syncing the schedule -------------------------------------------

    def _compile_config(self) -> None:
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
                entry = self.Entry(**dict(spec, name=name, app=self.app))
                compiled = compile_entry(entry, settings=self.settings, app=self.app)
            except BatonError as exc:
                self._refuse(name, str(exc))
                continue
            except Exception as exc:
                self._refuse(name, f"beat entry {name!r}: {exc!r}")
                continue
            self._compiled[name] = compiled
            self._config_names.add(name)

    def _refuse(self, name: str, reason: str) -> None:
        if self._refused.get(name) != reason:
            logger.error("beat: refusing %s; the other entries keep running", reason)
        self._refused[name] = reason

    def _edited_line(self, now: int) -> str:
        return json.dumps({"at": now, "kind": "edited"})

    def _reload(self) -> None:
        """Read every entry from the store; define config entries that are new or edited."""
        assert self._beat is not None
        beat = self._beat
        now = self.now_ms()
        version = int(beat.client.get(beat.keys.version) or 0)
        stored = beat.load()
        full = self._full_sync
        for name in list(self._compiled):
            if name not in self._config_names:
                del self._compiled[name]  # API entries are rebuilt from the store below
        for name, fields in stored.items():
            if fields.get("source") == "api" and name not in self._config_names:
                self._compile_api(name, fields.get("def", ""))
        pipe = beat.client.pipeline(transaction=False)
        defined: list[str] = []
        for name, c in self._compiled.items():
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
                    owner=self.owner,
                    fence=self._fence,
                    mode="sync",
                    name=name,
                    fingerprint=c.fingerprint,
                    next_slot=c.rule.first_after(now),
                    edited_line=self._edited_line(now),
                    history_max=self.settings.beat_history,
                    fields=c.fields(),
                    pipe=pipe,
                )
                defined.append(name)
        own = beat.keys.app
        stale = [
            n
            for n, f in stored.items()
            if n not in self._compiled and f.get("source") != "api" and f.get("app", own) == own
        ]
        for name in stale:
            beat.remove(owner=self.owner, fence=self._fence, name=name, source="config", pipe=pipe)
        results = pipe.execute()
        for name, result in zip(defined, results[: len(defined)], strict=True):
            if int(result[0]) == 0:
                self._leading = False
                return
            stored.setdefault(name, {})
            stored[name]["next"] = str(result[1])
            stored[name]["fp"] = self._compiled[name].fingerprint
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
            return
        if full or self._refused != self._refused_stored:
            beat.set_refused(self._refused)
            self._refused_stored = dict(self._refused)
        self._slots = {}
        self._triggers = []
        for name, c in self._compiled.items():
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
            self._slots[name] = slots
            if slots.trigger:
                self._triggers.append(name)
        self._due = [(s.next_ms, n) for n, s in self._slots.items() if not s.paused]
        heapq.heapify(self._due)
        self._version = version
        self._dirty = self._full_sync = False
        self._resend_outbox()

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
        assert self._beat is not None
        restores = []
        for name, (fingerprint, mine, last_slot, last_id) in self._claimed.items():
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
        pipe = self._beat.client.pipeline(transaction=False)
        for claim in restores:
            self._beat.claim(self.owner, self._fence, claim, self.settings.beat_history, pipe)
        for claim, result in zip(restores, pipe.execute(), strict=True):
            status = int(result[0])
            if status == 0:
                self._leading = False
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

    def _compile_api(self, name: str, definition: str) -> None:
        try:
            entry = entry_from_definition(name, definition, self.app)
            self._compiled[name] = compile_entry(
                entry, settings=self.settings, app=self.app, source="api", definition=definition
            )
            self._refused.pop(name, None)
        except BatonError as exc:
            self._refuse(name, str(exc))
        except Exception as exc:
            self._refuse(name, f"beat entry {name!r}: {exc!r}")

    # -- firing ----------------------------------------------------------------------

    def _fire_due(self, now: int) -> None:
        assert self._beat is not None
        claims: list[Claim] = []
        while self._due and self._due[0][0] <= now:
            next_ms, name = heapq.heappop(self._due)
            slots = self._slots.get(name)
            if slots is None or slots.next_ms != next_ms or slots.paused:
                continue
            claims.append(self._plan(name, slots, now))
        for name in self._triggers:
            slots = self._slots.get(name)
            if slots is not None and slots.trigger:
                claims.append(self._plan_trigger(name, slots, now))
        self._triggers = []
        if not claims:
            return
        pipe = self._beat.client.pipeline(transaction=False)
        for claim in claims:
            self._beat.claim(self.owner, self._fence, claim, self.settings.beat_history, pipe)
        try:
            results = pipe.execute()
        except _STORE_FAILURES:
            # Some claims may have been applied: the outbox has them, and the reload
            # after the store is back re-sends them under the same ids.
            self._dirty = True
            raise
        published: list[str] = []
        accepted: list[Claim] = []
        for claim, result in zip(claims, results, strict=True):
            status = int(result[0])
            if status == 0:
                logger.warning("beat: lost the leader lease while claiming; following")
                self._leading = False
                self._dirty = True
                break
            if status != 1:
                logger.info(
                    "beat: entry %r changed in the store (%s); reloading",
                    claim.name,
                    _CLAIM_REFUSED.get(status, f"status {status}"),
                )
                self._dirty = True
                continue
            accepted.append(claim)
            metrics.beat_fired.labels(claim.name).inc(claim.fired)
            metrics.beat_missed.labels(claim.name).inc(claim.missed)
            metrics.beat_suppressed.labels(claim.name).inc(claim.suppressed)
            slots = self._slots[claim.name]
            if claim.new_next is not None:
                self._claimed[claim.name] = (
                    claim.fingerprint,
                    claim.new_next,
                    claim.last_slot,
                    claim.last_id,
                )
                slots.next_ms = claim.new_next
                heapq.heappush(self._due, (claim.new_next, claim.name))
            else:
                slots.trigger = ""
            if claim.last_id:
                slots.last_id = claim.last_id
            if claim.last_slot is not None:
                slots.last_slot = claim.last_slot
            for task_id, payload in claim.outbox:
                if self._publish_slot(claim.name, task_id, json.loads(payload)):
                    published.append(task_id)
        if published:
            self._beat.sent(published)
        if accepted:
            self.fired(accepted)

    def fired(self, claims: list[Claim]) -> None:
        """Called by the leader with the claims the store accepted, after their slots
        were published: for a subclass that records runs elsewhere too (the Django
        scheduler writes django-celery-beat's ``last_run_at``)."""

    def _plan(self, name: str, slots: StoredSlots, now: int) -> Claim:
        c = self._compiled[name]
        plan = plan_due(c.rule, slots.next_ms, now, c.policy)
        fire, suppressed = plan.fire, []
        if fire and c.policy.overlap == "skip" and slots.last_id and self._running(slots.last_id):
            fire, suppressed = [], fire
        history: list[str] = []
        missed = len(plan.missed) + plan.missed_beyond
        if missed:
            line = {"at": now, "kind": "missed", "count": missed}
            if plan.missed:
                line.update(first=plan.missed[0], last=plan.missed[-1])
            history.append(json.dumps(line))
            logger.warning(
                "beat: entry %r missed %d slot(s) (misfire=%s)", name, missed, c.policy.misfire
            )
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
        assert self._beat is not None
        return slot_task_id(self.settings.key_prefix, name, slot, kind, app=self._beat.keys.app)

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

    def _resend_outbox(self) -> None:
        """Publish claimed-but-unsent slots (a leader died between claim and send)."""
        assert self._beat is not None
        self._outbox_at = time.monotonic() + self.ttl
        pending = self._beat.outbox()
        if not pending:
            return
        published: list[str] = []
        dropped: list[str] = []
        for task_id, item in pending.items():
            name = str(item.get("entry"))
            if name not in self._compiled:
                logger.warning("beat: dropping outbox item %s of unknown entry %r", task_id, name)
                dropped.append(task_id)
                continue
            logger.info(
                "beat: re-sending %r slot %s as %s", name, slot_time(item.get("slot")), task_id
            )
            if self._publish_slot(name, task_id, item):
                published.append(task_id)
        self._beat.sent(published + dropped)

    def _publish_slot(self, name: str, task_id: str, item: dict[str, Any]) -> bool:
        """Publish one outbox item's message; False (and it stays in the outbox) on error.
        An item claimed by an older version names no slot before it: sent without."""
        assert self._beat is not None
        c = self._compiled[name]
        slot_ms = int(item["slot"])
        series = None
        if "before" in item:
            series = SlotRun(self._beat.keys.app, name, slot_ms, item["before"])
        try:
            self.publish(c, slot_ms, task_id, scheduled=item.get("kind") == "fired", series=series)
        except Exception as exc:
            logger.error(
                "beat: could not publish %r slot %s (%s), will retry: %r",
                name,
                slot_ms,
                task_id,
                exc,
            )
            return False
        return True

    def publish(
        self,
        compiled: CompiledEntry,
        slot_ms: int,
        task_id: str,
        *,
        scheduled: bool = True,
        series: SlotRun | None = None,
    ) -> Any:
        """Send the message like Celery's beat does (``apply_async``/``send_task``), with
        the slot's task id and headers naming the entry and the slot; a ``scheduled``
        slot (not a trigger) also carries its misfire policy and the entry's next slot,
        which a worker that held it past the grace follows (worker/misfire.py)."""
        entry = compiled.entry
        logger.info(
            "Scheduler: Sending due task %s (%s) slot %s",
            entry.name,
            entry.task,
            slot_time(slot_ms),
        )
        args = [a() if isinstance(a, BeatLazyFunc) else a for a in entry.args or ()]
        kwargs = {
            k: v() if isinstance(v, BeatLazyFunc) else v for k, v in (entry.kwargs or {}).items()
        }
        options = compiled.send_options
        headers = dict(options.pop("headers", None) or {})
        # The slot header makes workers admit this slot's id once (policy/per_call.run_once).
        headers.update(celery_beat_task=True, baton_beat_entry=entry.name)
        headers[BEAT_SLOT_HEADER] = slot_ms
        if scheduled:
            policy = compiled.policy
            headers[MISFIRE_HEADER] = {
                "misfire": policy.misfire,
                "grace": policy.grace,
                "next": compiled.rule.following(slot_ms),
            }
        if series is not None:
            headers[SERIES_HEADER] = series.header()
        options.update(task_id=task_id, headers=headers, producer=self.producer)
        task = self.app.tasks.get(entry.task)
        if task is not None:
            return task.apply_async(args, kwargs, **options)
        return self.send_task(entry.task, args, kwargs, **options)
