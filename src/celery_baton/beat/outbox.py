"""Publishing a claimed slot, and re-sending the outbox.

A claim records its slots' messages in the outbox with the next slot, atomically
(``beat_claim``); the leader then publishes each under its slot's task id and clears
it. A leader killed in between leaves the item: the next leader publishes it under the
same id, and a worker admits a slot's id once (``policy/per_call.run_once``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from typing import Any

from celery.beat import BeatLazyFunc
from celery.utils.log import get_logger

from celery_baton.beat.entries import CompiledEntry
from celery_baton.beat.state import BeatState
from celery_baton.core.policy.headers import BEAT_SLOT_HEADER, MISFIRE_HEADER, SERIES_HEADER
from celery_baton.core.policy.slot_runs import SlotRun

logger = get_logger(__name__)

#: Namespace of the task ids derived from (key prefix, app, entry, slot).
SLOT_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "celery-baton:beat:slot")

#: ``Scheduler.publish``: sends one slot's message (a test records it instead).
Publish = Callable[..., Any]
#: ``Scheduler.resent``: told the outbox items (``{entry, slot, kind}``) a re-send published.
Resent = Callable[[list[dict[str, Any]]], None]


def slot_task_id(
    prefix: str, entry: str, slot_ms: int, kind: str = "fired", *, app: str = ""
) -> str:
    """The task id of ``entry``'s message for ``slot_ms``: the same in every beat of the
    app named ``app`` (its ``schedule_name``), different in another app, whose entry of
    the same name must not be taken for this one's (a worker runs a slot's id once)."""
    tag = "" if kind == "fired" else f"|{kind}"
    scope = f"{prefix}|{app}" if app else prefix
    return str(uuid.uuid5(SLOT_NAMESPACE, f"{scope}|{entry}|{slot_ms}{tag}"))


def slot_time(slot_ms: Any) -> str:
    """A slot (epoch milliseconds) as a UTC time for logs: 2026-06-01T09:00:00.000Z."""
    try:
        moment = datetime.fromtimestamp(int(slot_ms) / 1000, tz=timezone.utc)
    except (TypeError, ValueError, OverflowError):
        return str(slot_ms)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


class Outbox:
    """Publishes the leader's claimed slots; re-sends what a claim left unsent.

    ``compiled`` is the leader's compiled entries (read, never written), ``publish``
    sends one message, ``ttl`` is how often the outbox is read (the lease's ttl),
    ``resent`` is told what a re-send published (the leader that sends a slot records
    its run, whoever claimed it: the Django scheduler writes the row).
    """

    def __init__(
        self,
        state: BeatState,
        compiled: Mapping[str, CompiledEntry],
        publish: Publish,
        ttl: float,
        resent: Resent | None = None,
    ) -> None:
        self.state = state
        self.compiled = compiled
        self.publish = publish
        self.ttl = ttl
        self.resent = resent
        self.resend_at = 0.0  # monotonic

    def publish_slot(self, name: str, task_id: str, item: dict[str, Any]) -> bool:
        """Publish one outbox item's message; False (and it stays in the outbox) on error.
        An item claimed by an older version names no slot before it: sent without."""
        c = self.compiled[name]
        slot_ms = int(item["slot"])
        series = None
        if "before" in item:
            series = SlotRun(self.state.keys.app, name, slot_ms, item["before"])
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

    def resend(self) -> None:
        """Publish claimed-but-unsent slots (a leader died between claim and send)."""
        self.resend_at = time.monotonic() + self.ttl
        pending = self.state.outbox()
        if not pending:
            return
        published: list[str] = []
        dropped: list[str] = []
        sent_items: list[dict[str, Any]] = []
        for task_id, item in pending.items():
            name = str(item.get("entry"))
            if name not in self.compiled:
                logger.warning("beat: dropping outbox item %s of unknown entry %r", task_id, name)
                dropped.append(task_id)
                continue
            logger.info(
                "beat: re-sending %r slot %s as %s", name, slot_time(item.get("slot")), task_id
            )
            if self.publish_slot(name, task_id, item):
                published.append(task_id)
                sent_items.append(item)
        # Recorded before the items leave the outbox: a leader killed in between leaves
        # them to the next one, whose record of the same slots changes nothing.
        if sent_items and self.resent is not None:
            self.resent(sent_items)
        self.state.sent(published + dropped)


def slot_message(
    compiled: CompiledEntry, slot_ms: int, task_id: str, *, scheduled: bool, series: SlotRun | None
) -> tuple[list[Any], dict[str, Any], dict[str, Any]]:
    """A slot's message as Celery's beat sends it: (args, kwargs, options), with the
    slot's task id and headers naming the entry and the slot; a ``scheduled`` slot (not
    a trigger) also carries its misfire policy and the entry's next slot, which a worker
    that held it past the grace follows (worker/misfire.py)."""
    entry = compiled.entry
    args = [a() if isinstance(a, BeatLazyFunc) else a for a in entry.args or ()]
    kwargs = {k: v() if isinstance(v, BeatLazyFunc) else v for k, v in (entry.kwargs or {}).items()}
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
    options.update(task_id=task_id, headers=headers)
    return args, kwargs, options
