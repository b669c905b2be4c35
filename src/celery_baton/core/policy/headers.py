"""The message headers celery-baton stamps on a publish and reads back. Celery-free."""

from __future__ import annotations

#: The header that carries a call's per-call options (JSON, per_call.py).
CALL_HEADER = "baton_call"
#: The header that carries a superseding publish's order (supersede.py).
ORDER_HEADER = "baton_order"
#: The header that carries an ordered call's place in its key's line (ordered=,
#: core/ordered.py): "<record epoch>:<position>"; a retry keeps its run's.
ORDERED_HEADER = "baton_ordered"
#: The header the beat stamps on every message it sends: the slot it fires (epoch ms).
BEAT_SLOT_HEADER = "baton_beat_slot"
#: ... and the entry it fires.
BEAT_ENTRY_HEADER = "baton_beat_entry"
#: A scheduled slot's place in its entry's series: ``{"app": the app's schedule name,
#: "before": the entry's fired slot before this one (ms), or None}`` (slot_runs.py).
SERIES_HEADER = "baton_beat_series"
#: A scheduled beat slot's misfire policy, for a worker that held it past the grace:
#: ``{"misfire": "skip"|"latest"|"all", "grace": seconds, "next": the entry's next slot
#: (ms)}`` (worker/misfire.py).
MISFIRE_HEADER = "baton_beat_misfire"
#: The header that names one publish of a message (publish.py stamps it on every publish
#: path; a retry keeps its run's): a copy the broker redelivers carries the same value,
#: a new publish of the same task id (``Task.replace``, a frozen signature sent again,
#: ``apply_async(task_id=...)``) another. The redelivery guard refuses the first only.
PUBLISH_HEADER = "baton_publish"
#: Set on a publish by name of a task the publishing app does not have (``send_task``
#: from a service without the task's code): its options are unknown there, so nothing
#: of them was done at the publish (a ``unique`` claim, an ``ordered`` place...).
UNKNOWN_TASK_HEADER = "baton_unknown_task"


def published_unaware(headers: dict[str, object]) -> bool:
    """Whether a message was published by a process that did not know its task's
    options: by name from an app without the task, or without celery-baton (no publish
    stamp; a beat slot is stamped as such instead)."""
    if headers.get(UNKNOWN_TASK_HEADER):
        return True
    return PUBLISH_HEADER not in headers and BEAT_SLOT_HEADER not in headers


def new_publish_stamp(now_ms: int, token: str) -> str:
    """A new publish's stamp (``PUBLISH_HEADER``): when it was published (ms, the
    publisher's clock, in hex) and a random token. A cancel by key cancels the calls
    published until it (core/cancels.py), and a retry keeps its run's stamp, so its
    re-publish counts as published when the call first was."""
    return f"{now_ms:x}.{token}"


def stamp_time(stamp: object) -> int | None:
    """When the publish stamped ``stamp`` was published (ms), or None when the stamp does
    not say (a message from an older version, or sent without ``Baton``)."""
    if not isinstance(stamp, str):
        return None
    sent, dot, _ = stamp.partition(".")
    if not dot or not sent:
        return None
    try:
        return int(sent, 16)
    except ValueError:
        return None
