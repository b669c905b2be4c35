"""The runtime API (add / update / remove / pause / resume / trigger) and the listing.

Runtime entries live in the store and persist, under the app's own keys (its
``app.main``, like its beat); every beat's leader merges them with
``beat_schedule`` (a ``beat_schedule`` entry of the same name wins). The leader sees a
change on its next lease renewal (within ``baton_beat_lease_ttl / 3`` seconds).

>>> from celery.schedules import crontab
>>> schedules = ScheduleStore(app)                          # doctest: +SKIP
>>> schedules.add("nightly", "reports.build", crontab(hour=3, minute=0),
...               kwargs={"kind": "daily"}, options={"baton_misfire": "latest"})  # doctest: +SKIP
>>> schedules.pause("nightly"); schedules.trigger("nightly")  # doctest: +SKIP
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from typing import Any

from celery_baton.beat.entries import compile_entry, definition_json, entry_from_definition
from celery_baton.beat.state import UNNAMED_APP, BeatState, schedule_name
from celery_baton.config import Settings, suggest
from celery_baton.errors import BeatEntryError
from celery_baton.parts import parts_for
from celery_baton.store.connection import STORE_ERRORS, Store

_DEFINE_ERRORS = {
    -1: "already exists",
    -2: "does not exist",
    -3: "comes from beat_schedule; edit the configuration instead",
}


class ScheduleStore:
    """Change the schedule at runtime; every call is one store round trip or two.

    Errors name the entry (:class:`~celery_baton.errors.BeatEntryError`); a store
    that does not answer raises :class:`~celery_baton.errors.StoreUnavailable`.
    """

    def __init__(self, app: Any, *, store: Store | None = None) -> None:
        self.app = app
        parts = parts_for(app)
        self.settings: Settings = parts.settings
        self._owns_store = store is None
        self.store = store or parts.connect()
        self.state = BeatState(self.store, self.settings.key_prefix, schedule_name(app.main))

    def close(self) -> None:
        """Close the store connection (if this object opened it)."""
        if self._owns_store:
            self.store.client.close()

    def __enter__(self) -> ScheduleStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except STORE_ERRORS as exc:
            raise self.store.unavailable(exc) from exc

    def _server_ms(self) -> int:
        seconds, micros = self._call(self.state.client.time)
        return int(seconds) * 1000 + int(micros) // 1000

    def add(
        self,
        name: str,
        task: str,
        schedule: Any,
        *,
        args: Iterable[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> None:
        """Add an entry; it first fires at its first slot after now.

        ``schedule``: seconds, a ``timedelta``, a ``crontab``, a ``solar`` or a
        five-field cron string. Arguments and options must be JSON values.
        """
        definition = self._definition(name, task, schedule, args, kwargs or {}, options or {})
        self._define("add", name, definition)

    def update(
        self,
        name: str,
        *,
        task: str | None = None,
        schedule: Any = None,
        args: Iterable[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> None:
        """Change an API entry. A new schedule moves the next slot to the first one
        after now (no immediate run); other changes apply from the next slot."""
        raw = self._call(self.state.client.hget, self.state.keys.entry(name), "def")
        if not raw:
            raise BeatEntryError("does not exist or comes from beat_schedule", entry=name)
        current = entry_from_definition(name, raw, self.app)
        definition = self._definition(
            name,
            task if task is not None else current.task,
            schedule if schedule is not None else current.schedule,
            args if args is not None else current.args,
            kwargs if kwargs is not None else current.kwargs,
            options if options is not None else current.options,
        )
        self._define("update", name, definition)

    def remove(self, name: str) -> None:
        """Remove an API entry with its history and unsent slots."""
        status = int(self._call(self.state.remove, owner="", fence=0, name=name, source="api"))
        if status != 1:
            raise BeatEntryError(_DEFINE_ERRORS.get(status, f"status {status}"), entry=name)

    def pause(self, name: str) -> None:
        """Stop firing ``name`` (any entry) until :meth:`resume`."""
        self._mark(name, "pause")

    def resume(self, name: str) -> None:
        """Fire ``name`` again from its first slot after now; paused slots are not run."""
        self._mark(name, "resume")

    def trigger(self, name: str) -> None:
        """Fire one extra run of ``name`` now (its regular slots do not move)."""
        self._mark(name, "trigger")

    def describe(self) -> dict[str, Any]:
        """The listing of :func:`describe_schedule`."""
        return describe_schedule(self.store, self.settings.key_prefix, app=self.state.keys.app)

    # -- helpers ---------------------------------------------------------------------

    def _mark(self, name: str, op: str) -> None:
        if not self._call(self.state.mark, name, op):
            # `baton schedule pause tik`: name the entry meant (one more read, only here).
            names = [str(e.get("name")) for e in self.describe().get("entries", [])]
            raise BeatEntryError("does not exist" + suggest(name, names), entry=name)

    def _definition(
        self,
        name: str,
        task: str,
        schedule: Any,
        args: Iterable[Any],
        kwargs: Mapping[str, Any],
        options: Mapping[str, Any],
    ) -> str:
        try:
            return definition_json(task, schedule, args, kwargs, options)
        except (ValueError, TypeError) as exc:
            raise BeatEntryError(str(exc), entry=name) from exc

    def _define(self, mode: str, name: str, definition: str) -> None:
        try:
            entry = entry_from_definition(name, definition, self.app)
        except (ValueError, TypeError, KeyError) as exc:
            raise BeatEntryError(str(exc), entry=name) from exc
        compiled = compile_entry(
            entry, settings=self.settings, app=self.app, source="api", definition=definition
        )
        now = self._server_ms()
        result = self._call(
            self.state.define,
            owner="",
            fence=0,
            mode=mode,
            name=name,
            fingerprint=compiled.fingerprint,
            next_slot=compiled.rule.first_after(now),
            edited_line=json.dumps({"at": now, "kind": "edited"}),
            history_max=self.settings.beat_history,
            fields=compiled.fields(),
        )
        status = int(result[0])
        if status != 1:
            raise BeatEntryError(_DEFINE_ERRORS.get(status, f"status {status}"), entry=name)


def _iso(ms: str | int | None) -> str | None:
    if ms in (None, ""):
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(int(ms) / 1000)) + (
        f".{int(ms) % 1000:03d}Z"
    )


def describe_schedule(
    store: Store, prefix: str = "baton", *, app: str = UNNAMED_APP, history: int = 10
) -> dict[str, Any]:
    """Everything ``celery baton schedule`` shows about the schedule of the app whose
    ``schedule_name`` is ``app``, as plain JSON values.

    ``{"server_time", "app", "leader": {owner, fence, since, lease_age_s, ttl_s} | None,
    "entries": [{name, task, schedule, source, next_slot, last_slot, last_id, paused,
    policy, fired, missed, suppressed, history: [...]}], "outbox": [...], "refused": {}}``.
    Times are ISO 8601 UTC strings.
    """
    state = BeatState(store, prefix, app)
    keys = state.keys
    client = store.client
    try:
        pipe = client.pipeline(transaction=False)
        pipe.time()
        pipe.hgetall(keys.leader)
        pipe.pttl(keys.leader)
        pipe.hgetall(keys.outbox)
        pipe.hgetall(keys.refused)
        server, leader, pttl, outbox, refused = pipe.execute()
        entries = state.load()
        pipe = client.pipeline(transaction=False)
        for name in entries:
            pipe.lrange(keys.history(name), 0, history - 1)
        histories = pipe.execute()
    except STORE_ERRORS as exc:
        raise store.unavailable(exc) from exc
    now_ms = int(server[0]) * 1000 + int(server[1]) // 1000
    leader_info = None
    if leader:
        leader_info = {
            "owner": leader.get("owner"),
            "fence": int(leader.get("fence", 0)),
            "since": _iso(leader.get("since")),
            "lease_age_s": round((now_ms - int(leader.get("since", now_ms))) / 1000, 3),
            "ttl_s": round(int(pttl) / 1000, 3) if int(pttl) > 0 else None,
        }
    listed = []
    for (name, fields), lines in zip(entries.items(), histories, strict=True):
        listed.append(
            {
                "name": name,
                "task": fields.get("task"),
                "schedule": fields.get("schedule"),
                "source": fields.get("source"),
                "next_slot": _iso(fields.get("next")),
                "last_slot": _iso(fields.get("last_slot")),
                "last_id": fields.get("last_id"),
                "paused": fields.get("paused") == "1",
                "trigger_pending": bool(fields.get("trigger")),
                "policy": json.loads(fields.get("policy") or "{}"),
                "fired": int(fields.get("fired", 0)),
                "missed": int(fields.get("missed", 0)),
                "suppressed": int(fields.get("suppressed", 0)),
                "history": [_history_line(line) for line in lines],
            }
        )
    return {
        "server_time": _iso(now_ms),
        "app": app,
        "leader": leader_info,
        "entries": listed,
        "outbox": [
            {"task_id": task_id, **json.loads(payload)} for task_id, payload in outbox.items()
        ],
        "refused": dict(refused),
    }


def _history_line(raw: str) -> dict[str, Any]:
    line: dict[str, Any] = json.loads(raw)
    for key in ("at", "slot", "first", "last", "into"):
        if key in line:
            line[key] = _iso(line[key])
    return line
