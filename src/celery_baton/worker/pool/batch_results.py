"""The results of a batch's calls written together on a Redis result backend: one read
and one pipeline for the whole batch, where ``mark_as_done`` per call takes two round
trips each (Celery's ``_store_result`` reads a record before it writes it).

What is written is what Celery's ``RedisBackend`` writes for each call: the record
``_get_result_meta`` makes (``result_extended`` fields included), encoded (and
compressed) by the backend, under ``get_key_for_task``, with ``result_expires`` (or
``result_failure_expires`` for a failure), published on the record's key for the
callers waiting on pub/sub; a record that already says SUCCESS is left as it is.

Only the record is written here: what ``mark_as_done`` / ``mark_as_failure`` do after
it (errbacks) is left to them, called with ``store_result=False``. A call whose record
Celery writes with more than that (a chord's counter, the chain a failure propagates
to), a result too large for one Redis value, a backend that is not Celery's Redis backend
(or a subclass that changes how it writes), and a batch whose bulk write failed: the
per-call path.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from celery_baton import internals

logger = logging.getLogger("celery_baton.worker")


@dataclass(frozen=True)
class Written:
    """One call's outcome, to be written under its own task id: its request as Celery's
    trace would have it (``request``), and its result or error."""

    call_id: str
    request: Any
    ok: bool
    value: Any
    traceback: str | None = None


def bulk_eligible(item: Written) -> bool:
    """Whether Celery writes nothing but the call's record for it (see the module)."""
    request = item.request
    if getattr(request, "chord", None):
        return False  # on_chord_part_return counts it, per call
    if item.ok:
        return not getattr(request, "ignore_result", False)
    return not getattr(request, "chain", None)  # _fail_chain stores its next tasks' failure


def store(backend: Any, items: Sequence[Written]) -> set[str]:
    """Write ``items``' records on ``backend`` in one read and one pipeline; the ids
    written (every item's; none when ``backend`` is not Celery's Redis backend, or when
    the write failed: it is logged; the caller writes those one by one)."""
    if not items:
        return set()
    from celery import states

    writer = internals.redis_record_writer(backend)
    if writer is None:
        return set()
    make_record, longest = writer
    records: list[tuple[str, bytes | str, int | None]] = []
    for item in items:
        state = states.SUCCESS if item.ok else states.FAILURE
        try:
            meta = make_record(
                result=backend.encode_result(item.value, state),
                state=state,
                traceback=item.traceback,
                request=item.request,
            )
            meta["task_id"] = item.call_id
            encoded = backend.encode(meta)
        except Exception:
            continue  # a result it cannot encode: the per-call path fails it, logged
        if isinstance(encoded, str) and len(encoded) > longest:
            continue  # the per-call path refuses it with Celery's own error
        expires = backend.expires
        if state == states.FAILURE:
            failure_expires = getattr(backend, "failure_expires", None)  # Celery 5.7
            if failure_expires is not None:
                expires = failure_expires
        records.append((item.call_id, encoded, expires))
    if not records:
        return set()
    try:
        # backend.ensure retries on the connection errors (and by the policy) that
        # Celery's own set() retries on; writing a record twice writes the same record.
        written: set[str] = backend.ensure(_write, (backend, records))
    except Exception:
        logger.exception("%d results of a batch could not be written together", len(records))
        return set()
    return written


def _write(backend: Any, records: list[tuple[str, bytes | str, int | None]]) -> set[str]:
    from celery import states

    keys = [backend.get_key_for_task(call_id) for call_id, _, _ in records]
    current = backend.client.mget(keys)
    written: set[str] = set()
    with backend.client.pipeline() as pipe:
        for key, (call_id, encoded, expires), found in zip(keys, records, current, strict=True):
            # As _store_result: a record that says SUCCESS stays (a run repeated after a
            # lost worker must not overwrite it).
            if found and backend.decode_result(found)["status"] == states.SUCCESS:
                written.add(call_id)
                continue
            pipe.set(key, encoded, ex=expires or None)
            pipe.publish(key, encoded)
            written.add(call_id)
        pipe.execute()
    return written
