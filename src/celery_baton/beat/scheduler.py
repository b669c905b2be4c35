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

This class is Celery's scheduler interface; it is made of parts, each handed what it
needs: ``leader.py`` (the lease and the clock), ``reload.py`` (the entries and the
reload that keeps them in step with the store), ``firing.py`` (planning and claiming
due slots), ``outbox.py`` (publishing a claimed slot, re-sending the outbox).
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

import celery.beat
from celery.beat import ScheduleEntry
from celery.utils.log import get_logger

from celery_baton import metrics
from celery_baton.beat.entries import CompiledEntry
from celery_baton.beat.firing import STORE_FAILURES, Firing
from celery_baton.beat.leader import Leader
from celery_baton.beat.outbox import Outbox, slot_message, slot_task_id, slot_time
from celery_baton.beat.reload import Entries
from celery_baton.beat.state import BeatState, Claim, schedule_name
from celery_baton.config import Settings
from celery_baton.core.policy.slot_runs import SlotRun
from celery_baton.errors import ConfigError
from celery_baton.parts import parts_for
from celery_baton.store.connection import Store

__all__ = ["Scheduler", "slot_task_id"]

logger = get_logger(__name__)


class Scheduler(celery.beat.Scheduler):  # type: ignore[misc]
    """Celery beat scheduler keeping its state in the store; see the module docstring.

    >>> app.conf.beat_scheduler = "celery_baton.beat:Scheduler"  # doctest: +SKIP

    ``clock`` (epoch milliseconds) replaces the store's clock: for tests only. The parts
    that need the store (``entries``, ``firing``, ``outbox``) are built in
    ``setup_schedule``, when it is connected.
    """

    entries: Entries
    firing: Firing
    outbox: Outbox

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
        owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.leader = Leader(owner, self.settings.beat_lease_ttl, clock)
        self._store = store
        self._owns_store = store is None
        self._beat: BeatState | None = None
        super().__init__(app, *args, **kwargs)

    # -- Celery's Scheduler interface -----------------------------------------------

    @property
    def ttl(self) -> float:
        return self.settings.beat_lease_ttl

    @property
    def owner(self) -> str:
        return self.leader.owner

    def setup_schedule(self) -> None:
        if self._store is None:
            self._store = self.parts.connect(
                socket_timeout=min(self.settings.socket_timeout, self.ttl / 3),
                client_name="baton-beat",
            )
        state = BeatState(self._store, self.settings.key_prefix, schedule_name(self.app.main))
        self._beat = state
        self.leader.attach(state)
        self.entries = Entries(self.app, self.settings, state, self.leader, self.Entry)
        self.outbox = Outbox(state, self.entries.compiled, self.publish, self.ttl, self.resent)
        self.firing = Firing(
            self.app, self.settings, state, self.leader, self.entries, self.outbox, self.fired
        )
        metrics.serve(self.settings.metrics_port)
        self.entries.compile_config()

    def get_schedule(self) -> dict[str, ScheduleEntry]:
        return {name: c.entry for name, c in self.entries.compiled.items()}

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
            self.leader.resign()
        except STORE_FAILURES as exc:
            logger.warning("beat: could not resign the leader lease: %r", exc)
        finally:
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
        except STORE_FAILURES as exc:
            self.leader.store_failed(exc)
            self.entries.dirty = True
        except Exception:
            logger.exception("beat: tick failed; trying again in 1 s")
            self.entries.dirty = True
        return 1.0

    # -- the loop --------------------------------------------------------------------

    def now_ms(self) -> int:
        """Now, in epoch milliseconds, by the store's clock (or the injected one)."""
        return self.leader.now_ms()

    @property
    def leading(self) -> bool:
        return self.leader.leading

    def _tick(self) -> float:
        leader, entries = self.leader, self.entries
        mono = time.monotonic()
        if leader.due(mono):
            reply, new_term = leader.renew(mono)
            if new_term:
                entries.full_sync = entries.dirty = True
            if reply.leading and reply.version != entries.version:
                entries.dirty = True  # edited in the store (the runtime API)
        if not leader.leading:
            return leader.wait()
        if entries.dirty:
            self._reload()
            if not leader.leading:
                return leader.wait()
        self._fire_due(self.now_ms())
        if time.monotonic() >= self.outbox.resend_at:
            self._resend_outbox()
        return self._delay()

    def _delay(self) -> float:
        delay = min(self.leader.renew_at - time.monotonic(), float(self.max_interval))
        next_ms = self.entries.next_ms()
        if next_ms is not None:
            delay = min(delay, (next_ms - self.now_ms()) / 1000)
        return max(delay, 0.0)

    # -- the parts' steps, each a hook a subclass may extend (beat/django.py) -------------

    def _reload(self) -> None:
        """Read the schedule from the store again; then re-send what a claim left unsent."""
        if self.entries.reload():
            self.outbox.resend()

    def _fire_due(self, now: int) -> None:
        self.firing.fire_due(now)

    def _resend_outbox(self) -> None:
        self.outbox.resend()

    def fired(self, claims: list[Claim]) -> None:
        """Called by the leader with the claims the store accepted, after their slots
        were published: for a subclass that records runs elsewhere too (the Django
        scheduler writes django-celery-beat's ``last_run_at``)."""

    def resent(self, items: list[dict[str, Any]]) -> None:
        """Called by the leader with the outbox items (``{entry, slot, kind}``) it
        re-sent: slots another leader claimed and did not send (or did not clear), for
        a subclass that records runs elsewhere too. The same slot may come again (sent,
        then re-sent): a record of it must change nothing the second time."""

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
        the slot's task id and headers naming the entry and the slot (``slot_message``)."""
        entry = compiled.entry
        logger.info(
            "Scheduler: Sending due task %s (%s) slot %s",
            entry.name,
            entry.task,
            slot_time(slot_ms),
        )
        args, kwargs, options = slot_message(
            compiled, slot_ms, task_id, scheduled=scheduled, series=series
        )
        options["producer"] = self.producer
        task = self.app.tasks.get(entry.task)
        if task is not None:
            return task.apply_async(args, kwargs, **options)
        return self.send_task(entry.task, args, kwargs, **options)
