"""A scheduled beat slot that ran, recorded in one key per entry, not one per slot.

A beat slot must *run* once even when it is *sent* twice (policy.run_once), so a worker
remembers that it ran. One key per slot for a day is 86,400 keys a day for a 1 s entry;
instead each message names the fired slot before its own in its entry's series (header
:data:`SERIES_HEADER`, written by the beat's claim, which knows it exactly), and the
worker records the slots that ran as *runs* of consecutive fired slots in one sorted set
per entry (release.lua). Slots that run in order extend one run: the record stays one
member however often the entry fires; out of order, a run per gap until the gap's slot
runs (the gate's ``SlotNotRun``, gate/slot_not_run.lua, refuses a slot inside a recorded
run). Celery-free.

A message without the header (a manual trigger, or a message sent by an older beat) is
recorded by its task id as before (a done marker for ``per_call.BEAT_SLOT_RETENTION``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from celery_baton.core.policy.headers import BEAT_ENTRY_HEADER, BEAT_SLOT_HEADER, SERIES_HEADER


def beat_base(prefix: str, app: str) -> str:
    """The start of every key of the beat schedule of the app named ``app`` (its hash
    tag keeps them on one Cluster slot): beat/state.py's keys, and the entry's hash and
    history a worker counts a held slot it did not run in (worker/misfire.py)."""
    return f"{prefix}:{{beat:{app}}}"


@dataclass(frozen=True)
class SlotRun:
    """A scheduled slot of ``entry`` (of the app whose schedule is ``app``) and the slot
    its entry fired before it (None: the first of its series)."""

    app: str
    entry: str
    slot: int
    before: int | None

    @property
    def link(self) -> str:
        """How release.lua reads it: ``"<slot> <before>"`` (nothing after the space for
        the first slot of a series)."""
        return f"{self.slot} {'' if self.before is None else self.before}"

    def header(self) -> dict[str, Any]:
        return {"app": self.app, "before": self.before}


def slot_run(headers: Mapping[str, Any]) -> SlotRun | None:
    """The scheduled slot a message's headers name, or None: no series header (a
    trigger, an older beat's message) or one that does not read (then it is judged by
    its task id, as before)."""
    series = headers.get(SERIES_HEADER)
    if not isinstance(series, Mapping):
        return None
    try:
        slot = int(headers[BEAT_SLOT_HEADER])
        before_raw = series.get("before")
        before = None if before_raw is None else int(before_raw)
        app, entry = str(series["app"]), str(headers[BEAT_ENTRY_HEADER])
    except (KeyError, TypeError, ValueError):
        return None
    if slot <= 0 or (before is not None and not 0 < before < slot):
        return None
    return SlotRun(app, entry, slot, before)
