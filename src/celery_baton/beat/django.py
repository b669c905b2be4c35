"""``celery_baton.beat.django:DjangoScheduler``: django-celery-beat's schedule, fired once.

django-celery-beat keeps a Django project's schedule in its tables (``PeriodicTask``
with an interval, crontab, solar or clocked schedule), edited in the admin. Its own
``DatabaseScheduler`` fires every entry once per running beat, so a project may run one
beat only. This scheduler reads the same tables and fires through celery-baton's leader
and slot claims (``beat/scheduler.py``): run it on as many hosts as you like::

    celery -A proj beat -S celery_baton.beat.django:DjangoScheduler

* Only the leader reads the tables: all rows when it starts to lead, then again each
  time ``PeriodicTasks.last_update`` (django-celery-beat's change signal, bumped by
  every admin save and delete) moves; it looks every ``baton_beat_django_poll`` s.
* A row is an entry under its own name (stored with source ``django``); an edit of
  *when* it fires moves its next slot to the first one after now (seed 001's
  "changed 10:00 to 10:30 at 11:00" does not fire at once), any other edit applies
  from the next slot. A disabled or deleted row's entry is removed.
* After a fire the leader writes the row's ``last_run_at`` (the slot's instant) and
  ``total_run_count`` with an UPDATE of those two columns, which bumps no change
  signal (as django-celery-beat's ``ModelEntry.save`` does not). A one-off row is then
  disabled, as django-celery-beat leaves it (``enabled=False``, count 0).
* ``beat_schedule`` in the settings stays as with ``celery_baton.beat:Scheduler``, never
  written to the tables; a row of the same name is left out (logged). A row whose
  ``expires`` passed is left out and disabled, as django-celery-beat does.

A row's ``baton_*`` policies go in its ``headers`` JSON (taken out before sending). A
clocked row fires once, even late (its ``baton_misfire`` defaults to ``latest``).
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from celery.beat import ScheduleEntry
from celery.schedules import crontab, solar
from celery.utils.log import get_logger

from celery_baton.beat.entries import CompiledEntry, compile_entry
from celery_baton.beat.scheduler import Scheduler
from celery_baton.beat.slots import UTC, IntervalRule, SlotRule, fingerprint, from_ms, to_ms
from celery_baton.beat.state import Claim
from celery_baton.errors import BatonError

logger = get_logger(__name__)

#: The next slot of an entry that fires no more (a one-off after its slot): a valid
#: instant (listings print it), far beyond any real slot.
NEVER_MS = to_ms(datetime(9999, 1, 1, tzinfo=UTC))
#: An entry stops this long before its ``expires``: the check runs just before firing.
EXPIRY_MARGIN_MS = 1000


@dataclass(frozen=True)
class ClockedRule:
    """django-celery-beat's ``clocked``: one slot at ``at_ms``, due even if it passed."""

    at_ms: int
    definition: dict[str, Any] = field(init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "definition", {"kind": "clocked", "at": self.at_ms})

    def following(self, slot_ms: int) -> int:
        return NEVER_MS

    def first_after(self, now_ms: int) -> int:
        return self.at_ms

    def skip_to(self, slot_ms: int, now_ms: int) -> int:
        return slot_ms if slot_ms > now_ms else NEVER_MS


@dataclass(frozen=True)
class RowRule:
    """A row's schedule with django-celery-beat's bounds: no slot before ``start_time``,
    one slot only for a one-off row.

    ``armed`` (a one-off's ``date_changed``) is part of *when* it fires: an admin save
    of a one-off row arms it again. ``resume_ms`` (an interval row's ``last_run_at`` +
    interval) is not: it keeps the cadence of a row new to the store (moving from
    django-celery-beat's scheduler) or whose interval was edited.
    """

    base: SlotRule
    start_ms: int | None = None
    once: bool = False
    armed: str = ""
    resume_ms: int | None = field(default=None, compare=False)
    definition: dict[str, Any] = field(init=False, compare=False)

    def __post_init__(self) -> None:
        definition: dict[str, Any] = {"base": self.base.definition, "start": self.start_ms}
        if self.once:
            definition.update(once=True, armed=self.armed)
        object.__setattr__(self, "definition", definition)

    def following(self, slot_ms: int) -> int:
        return NEVER_MS if self.once else self.base.following(slot_ms)

    def first_after(self, now_ms: int) -> int:
        if self.start_ms is not None and self.start_ms > now_ms:
            if isinstance(self.base, IntervalRule):
                return self.start_ms  # as django-celery-beat: the first run at start_time
            return self.base.first_after(self.start_ms - 1)
        if self.resume_ms is not None and self.resume_ms > now_ms:
            return self.resume_ms
        return self.base.first_after(now_ms)

    def skip_to(self, slot_ms: int, now_ms: int) -> int:
        if self.once:
            return slot_ms if slot_ms > now_ms else NEVER_MS
        return self.base.skip_to(slot_ms, now_ms)


@dataclass(frozen=True)
class RowRef:
    """What the leader writes back to after a fire."""

    pk: Any
    one_off: bool


def _ms(value: datetime) -> int:
    """A datetime from the tables as epoch ms (a naive one is in Django's TIME_ZONE)."""
    from django.utils import timezone

    if timezone.is_naive(value):
        value = timezone.make_aware(value, timezone.get_default_timezone())
    return to_ms(value)


def _db_time(slot_ms: int) -> datetime:
    """A slot as Django stores datetimes: aware UTC with USE_TZ, else naive local time."""
    from django.conf import settings
    from django.utils import timezone

    moment = from_ms(slot_ms)
    if settings.USE_TZ:
        return moment
    naive: datetime = timezone.make_naive(moment, timezone.get_default_timezone())
    return naive


def entry_for_row(row: Any, app: Any) -> tuple[ScheduleEntry, SlotRule | None]:
    """A ``PeriodicTask`` as a Celery entry, with what django-celery-beat's ``ModelEntry``
    sends (args, kwargs, queue, exchange, routing key, priority, expires, headers with
    ``periodic_task_name``); the rule of a clocked row (which Celery cannot express)."""
    from django.conf import settings

    headers = json.loads(row.headers or "{}")
    options: dict[str, Any] = {k: headers.pop(k) for k in list(headers) if k.startswith("baton_")}
    for option in ("queue", "exchange", "routing_key", "priority"):
        if getattr(row, option) is not None:
            options[option] = getattr(row, option)
    if row.expires or row.expire_seconds:
        options["expires"] = row.expires or row.expire_seconds
    headers["periodic_task_name"] = row.name
    options["headers"] = headers
    rule: SlotRule | None = None
    if row.interval is not None:
        schedule = row.interval.schedule
    elif row.crontab is not None:
        c = row.crontab
        schedule = crontab(c.minute, c.hour, c.day_of_week, c.day_of_month, c.month_of_year)
        if getattr(settings, "DJANGO_CELERY_BEAT_TZ_AWARE", True):
            options.setdefault("baton_timezone", str(c.timezone))
    elif row.solar is not None:
        s = row.solar
        schedule = solar(s.event, float(s.latitude), float(s.longitude), app=app)
    elif row.clocked is not None:
        schedule = row.clocked.schedule
        rule = ClockedRule(_ms(row.clocked.clocked_time))
        options.setdefault("baton_misfire", "latest")
    else:
        raise ValueError("has no schedule (interval, crontab, solar or clocked)")
    entry = ScheduleEntry(
        name=row.name,
        task=row.task,
        schedule=schedule,
        args=tuple(json.loads(row.args or "[]")),
        kwargs=json.loads(row.kwargs or "{}"),
        options=options,
        app=app,
    )
    return entry, rule


class DjangoScheduler(Scheduler):
    """celery-baton's scheduler over django-celery-beat's tables; see the module docstring.

    >>> CELERY_BEAT_SCHEDULER = "celery_baton.beat.django:DjangoScheduler"  # doctest: +SKIP
    """

    def __init__(self, app: Any, *args: Any, **kwargs: Any) -> None:
        self._rows: dict[str, RowRef] = {}
        self._db_entries: dict[str, CompiledEntry] = {}
        self._db_refused: set[str] = set()
        self._settings_names: set[str] = set()
        self._shadowed: set[str] = set()
        self._db_stamp: Any = None
        self._db_stale = True
        self._poll_at = 0.0
        self._expires_at = NEVER_MS
        self._db_error_logged = 0.0
        super().__init__(app, *args, **kwargs)

    def setup_schedule(self) -> None:
        try:
            import django
            from django.apps import apps
            from django.core.exceptions import ImproperlyConfigured
        except ImportError as exc:
            # Said in one line: raised here, Celery's beat logged the traceback one
            # character a line (700 lines).
            raise SystemExit(
                f"celery_baton.beat.django: {exc.name or 'django'} is not installed: install "
                "celery-baton with its [django] extra (Django and django-celery-beat)"
            ) from None
        try:
            if not apps.ready:
                django.setup()
            from django_celery_beat.models import PeriodicTask  # noqa: F401
        except ImportError as exc:
            raise SystemExit(
                f"celery_baton.beat.django: {exc.name or exc} is not installed: install "
                "celery-baton with its [django] extra (Django and django-celery-beat)"
            ) from None
        except (ImproperlyConfigured, RuntimeError) as exc:
            raise SystemExit(f"celery_baton.beat.django: Django is not set up: {exc}") from None
        super().setup_schedule()
        self._settings_names = set(self.entries.config_names)

    def close(self) -> None:
        try:
            super().close()
        finally:
            from django.db import connections

            connections.close_all()

    @property
    def info(self) -> str:
        return f"{super().info}\n    . entries -> django-celery-beat's tables"

    # -- when to read the tables ---------------------------------------------------

    def _tick(self) -> float:
        if self.leading:
            mono = time.monotonic()
            if self.now_ms() + EXPIRY_MARGIN_MS >= self._expires_at:
                self._db_stale = self.entries.dirty = True
            if mono >= self._poll_at:
                self._poll_at = mono + self.settings.beat_django_poll
                if self._db_stale or self._tables_changed():
                    self._db_stale = self.entries.dirty = True
        delay = super()._tick()
        if self.leading:
            delay = min(delay, max(self._poll_at - time.monotonic(), 0.0))
        return delay

    def _tables_changed(self) -> bool:
        from django.db import Error, close_old_connections
        from django_celery_beat.models import PeriodicTasks

        try:
            close_old_connections()
            stamp = PeriodicTasks.last_change()
        except Error as exc:
            self._db_failed(exc)
            return False
        if stamp != self._db_stamp:
            logger.info("beat: django-celery-beat's schedule changed; reading it")
            return True
        return False

    def _db_failed(self, exc: BaseException) -> None:
        mono = time.monotonic()
        if mono - self._db_error_logged > 10:
            logger.warning("beat: the database did not answer; keeping the entries read: %r", exc)
            self._db_error_logged = mono

    # -- reading the tables --------------------------------------------------------

    def _reload(self) -> None:
        entries = self.entries
        if (entries.full_sync or self._db_stale) and not self._read_tables() and entries.full_sync:
            # Without its rows the reload would take their entries for removed ones
            # (and drop their unsent slots): wait for the database, firing nothing.
            entries.dirty = True
            return
        # The reload drops the names not in config_names: rows count as configuration.
        entries.config_names = self._settings_names | set(self._db_entries)
        entries.compiled.update(self._db_entries)
        super()._reload()

    def _resend_outbox(self) -> None:
        if not self.entries.full_sync:  # before the rows are read their items look unknown
            super()._resend_outbox()

    def _read_tables(self) -> bool:
        from django.db import Error, close_old_connections
        from django_celery_beat.models import PeriodicTask, PeriodicTasks

        try:
            close_old_connections()
            # The stamp first: an edit after it bumps it again and is read next poll.
            stamp = PeriodicTasks.last_change()
            rows = list(
                PeriodicTask.objects.filter(enabled=True).select_related(
                    "interval", "crontab", "solar", "clocked"
                )
            )
        except Error as exc:
            self._db_failed(exc)
            return False
        now = self.now_ms()
        entries: dict[str, CompiledEntry] = {}
        refs: dict[str, RowRef] = {}
        refused: set[str] = set()
        expired: list[Any] = []
        self._expires_at = NEVER_MS
        for row in rows:
            if row.name in self._settings_names:
                if row.name not in self._shadowed:
                    logger.warning(
                        "beat: django-celery-beat's row %r is left out: beat_schedule has an "
                        "entry of that name",
                        row.name,
                    )
                    self._shadowed.add(row.name)
                continue
            if row.expires is not None:
                expires = _ms(row.expires)
                if expires <= now + EXPIRY_MARGIN_MS:
                    expired.append(row.pk)
                    continue
                self._expires_at = min(self._expires_at, expires)
            try:
                entries[row.name] = self._compile_row(row)
            except BatonError as exc:
                self.entries.refuse(row.name, str(exc))
                refused.add(row.name)
                continue
            except Exception as exc:
                self.entries.refuse(row.name, f"beat entry {row.name!r}: {exc!r}")
                refused.add(row.name)
                continue
            self.entries.refused.pop(row.name, None)
            refs[row.name] = RowRef(row.pk, bool(row.one_off or row.clocked_id))
        for name in self._db_refused - refused:
            self.entries.refused.pop(name, None)
        self._db_entries, self._rows, self._db_refused = entries, refs, refused
        self._db_stamp, self._db_stale = stamp, False
        if expired:
            self._update(expired, enabled=False, last_run_at=None)
            logger.info("beat: disabled %d expired row(s) of django-celery-beat", len(expired))
        return True

    def _compile_row(self, row: Any) -> CompiledEntry:
        entry, rule = entry_for_row(row, self.app)
        compiled = compile_entry(entry, settings=self.settings, app=self.app, source="django")
        base = rule or compiled.rule
        resume = None
        if isinstance(base, IntervalRule) and row.last_run_at is not None:
            resume = _ms(row.last_run_at) + base.ms
        full = RowRule(
            base=base,
            start_ms=_ms(row.start_time) if row.start_time is not None else None,
            once=bool(row.one_off or row.clocked_id),
            armed=str(row.date_changed) if row.one_off else "",
            resume_ms=resume,
        )
        return dataclasses.replace(compiled, rule=full, fingerprint=fingerprint(full))

    # -- writing back --------------------------------------------------------------

    def fired(self, claims: list[Claim]) -> None:
        """Write each fired row's ``last_run_at`` and ``total_run_count``; disable a
        one-off row (django-celery-beat's end state: disabled, count 0, no last run)."""
        for claim in claims:
            self._record_runs(claim.name, claim.fired, claim.last_slot)

    def resent(self, items: list[dict[str, Any]]) -> None:
        """The slots this leader re-sent for a leader that claimed them and died: their
        rows are written as if this leader had fired them (it is the one that sent)."""
        runs: dict[str, list[int | None]] = {}
        for item in items:
            slot = int(item["slot"]) if item.get("kind") == "fired" else None
            runs.setdefault(str(item.get("entry")), []).append(slot)
        for name, slots in runs.items():
            scheduled = [slot for slot in slots if slot is not None]
            self._record_runs(name, len(slots), max(scheduled) if scheduled else None)

    def _record_runs(self, name: str, runs: int, last_slot: int | None) -> None:
        """``runs`` more runs of ``name``'s row, the last at ``last_slot``. Only a row
        whose ``last_run_at`` is before ``last_slot`` is written: the same slots recorded
        again (a leader killed after its write, before clearing the outbox: the next one
        re-sends them) change nothing."""
        from django.db.models import F

        ref = self._rows.get(name)
        if ref is None or not runs:
            return
        if ref.one_off:  # django-celery-beat's one-off disable bumps the change signal
            self._update([ref.pk], bump=True, enabled=False, total_run_count=0, last_run_at=None)
            return
        values: dict[str, Any] = {"total_run_count": F("total_run_count") + runs}
        if last_slot is None:  # a triggered run: counted, its slot is not the schedule's
            self._update([ref.pk], **values)
            return
        at = _db_time(last_slot)
        self._update([ref.pk], before=at, last_run_at=at, **values)

    def _update(
        self, pks: list[Any], *, bump: bool = False, before: datetime | None = None, **values: Any
    ) -> None:
        """An UPDATE of these columns only: no model save, so no change signal (unless
        ``bump``), and an admin edit of the other columns at that moment is not undone.
        With ``before``: only rows whose ``last_run_at`` is unset or earlier."""
        from django.db import Error
        from django.db.models import Q
        from django_celery_beat.models import PeriodicTask, PeriodicTasks

        rows = PeriodicTask.objects.filter(pk__in=pks)
        if before is not None:
            rows = rows.filter(Q(last_run_at__isnull=True) | Q(last_run_at__lt=before))
        try:
            rows.update(**values)
            if bump:
                PeriodicTasks.update_changed()
        except Error as exc:
            logger.warning("beat: could not write to django-celery-beat's table: %r", exc)
