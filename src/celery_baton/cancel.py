"""``baton.cancel``: a cancel that sticks, the caller's side (core/cancels.py: the records;
worker/cancelling.py: what a worker does with a cancelled delivery).

A cancel by id is written to the store (so every worker, also one started later, finds
it when the message reaches it), and the call's result is marked ``REVOKED`` at once
(``AsyncResult.get()`` raises ``TaskRevokedError``) unless the call already finished or
its result says it runs (``STARTED``, with ``task_track_started``). ``terminate=True``
also sends Celery's ``revoke(terminate=True)`` for a running body. A cancel by key
cancels every call of the task whose arguments hold the key's values and that was
published until now; each is marked ``REVOKED`` by the worker that receives it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from celery import states

from celery_baton.core.cancels import Cancels, KeyCancel, covering, key_material
from celery_baton.core.keys import KeySpec
from celery_baton.core.policy.headers import PUBLISH_HEADER, stamp_time
from celery_baton.core.revoke_notices import KEY_ARG, tell
from celery_baton.errors import BatonError, KeySpecError, StoreUnavailable
from celery_baton.parts import AppParts, task_option
from celery_baton.store.connection import STORE_ERRORS
from celery_baton.worker.planning import delivery_policy
from celery_baton.worker.transport.broker import read_broker
from celery_baton.worker.transport.queued import (
    delivered_messages,
    message_call,
    queued_message,
    queued_messages_of,
)

logger = logging.getLogger("celery_baton")

_Found = TypeVar("_Found")

#: How long a cancel is kept when neither ``ttl=`` nor ``baton_cancel_ttl`` says, and
#: the broker has no visibility timeout (AMQP).
DEFAULT_TTL = 24 * 3600.0

#: Seconds ``terminate=True`` waits for the workers' list of running tasks (by key).
INSPECT_TIMEOUT = 1.0
#: Seconds a cancel by id waits for the worker that holds a unique call unstarted to
#: free its key (told by the cancel's notice; milliseconds when it answers).
FREED_IN_A_WORKER_WAIT = 2.0


@dataclass(frozen=True)
class Cancelled:
    """What a cancel did: ``what`` in words, ``ttl`` (seconds it is kept), ``revoked``
    (the result marked REVOKED now), ``terminated`` (running task ids sent a revoke),
    ``state``: a cancel by id, its call's result state before the cancel (None: no
    result backend, or a cancel by key)."""

    what: str
    ttl: float
    revoked: bool = False
    terminated: tuple[str, ...] = ()
    state: str | None = None


def cancel_ttl(parts: AppParts, ttl: float | None) -> float:
    """``ttl`` given, else ``baton_cancel_ttl``, else the longest a message delivered
    before the cancel may take to come back: the broker's redelivery window when it has
    one (its visibility timeout counts from the delivery, then kombu's restore scan
    and mutex, and the copy's wait: twice the timeout and those), else
    :data:`DEFAULT_TTL`. Kept only the visibility timeout from the cancel, a cancel made
    just after its call's delivery expired before a killed worker's copy came back."""
    if ttl is not None:
        if not isinstance(ttl, int | float) or ttl <= 0:
            raise BatonError(f"baton.cancel: ttl must be seconds > 0, got {ttl!r}")
        return float(ttl)
    if parts.settings.cancel_ttl is not None:
        return parts.settings.cancel_ttl
    return read_broker(parts.app).redelivery_window or DEFAULT_TTL


def cancel(
    parts: AppParts,
    task_id: str | None = None,
    *,
    task: Any = None,
    key: Mapping[str, Any] | None = None,
    terminate: bool = False,
    ttl: float | None = None,
    records: Cancels | None = None,
) -> Cancelled:
    """See ``Baton.cancel``. ``records``: the store's cancels to write to (the CLI's own
    connection, which never starts an embedded store); default the app's."""
    kept = cancel_ttl(parts, ttl)
    records = records or parts.cancels
    if task_id is not None:
        if task is not None or key is not None:
            raise BatonError("baton.cancel: a task id, or task= and key=, not both")
        if not isinstance(task_id, str) or not task_id:
            raise BatonError(f"baton.cancel: a task id is a non-empty str, got {task_id!r}")
        return _cancel_id(parts, records, task_id, terminate=terminate, ttl=kept)
    if task is None or key is None:
        raise BatonError("baton.cancel: give a task id, or task= and key=")
    return _cancel_key(parts, records, task, key, terminate=terminate, ttl=kept)


def _cancel_id(
    parts: AppParts, records: Cancels, task_id: str, *, terminate: bool, ttl: float
) -> Cancelled:
    held_under = records.cancel_id(task_id, ttl=ttl)
    if held_under:
        # A worker holds it for its countdown or ETA, and will not start it (its start
        # reads this cancel): its unique key is freed before REVOKED is seen, so that a
        # publish made after it is a new run. Owner-compared: a claim a new publish took
        # meanwhile stays.
        records.free_held(held_under, task_id)
    elif not _free_if_queued(parts, records, task_id):
        _await_freed_in_workers(parts, "id", task_id)
    app = parts.app
    revoked = False
    backend = app.backend
    state = None
    if not _disabled(backend):
        state = backend.get_state(task_id)
        # A finished call keeps its outcome; a running one is marked by its worker when
        # terminated (or ends as it ends).
        if state not in states.READY_STATES and state != states.STARTED:
            backend.mark_as_revoked(task_id, "cancelled (baton.cancel)")
            revoked = True
    terminated: tuple[str, ...] = ()
    if terminate:
        app.control.revoke(task_id, terminate=True)
        _tell_revoke(parts, {"task_id": [task_id], "terminate": True})
        terminated = (task_id,)
    logger.info("baton: cancelled task %s for %.0fs", task_id, ttl)
    return Cancelled(f"task {task_id}", ttl, revoked=revoked, terminated=terminated, state=state)


def _free_if_queued(parts: AppParts, records: Cancels, task_id: str) -> bool:
    """A ``unique`` call whose message waits in a queue of the broker, not delivered to
    any worker: its unique key is freed now (owner-compared: a claim a new publish took
    meanwhile stays), so that a publish after the cancel is a new run, not deduplicated
    into the call that will never start. Safe: its cancel is in the store already, and
    the worker that takes the message later reads it before any start. Only on kombu's
    Redis transport (no other broker can be read without taking the message); anywhere
    else the key is freed when a worker discards the message. False when the call was
    not found waiting in a queue (it may be in a worker)."""
    app = parts.app
    if not any(task_option(task, "unique") for task in app.tasks.values()):
        return True  # no unique task here: nothing to free, nowhere to look
    message = _looked_up(lambda: queued_message(app, task_id), task_id)
    if message:
        _free_unique_key(parts, records, message, None)
    return bool(message)


def _free_queued_of_key(
    parts: AppParts, records: Cancels, name: str, cancel: KeyCancel, fun: Any
) -> None:
    """The calls of ``name`` that ``cancel`` covers and whose messages wait in a queue
    of the broker: their unique keys freed now, as :func:`_free_if_queued` frees one;
    those a worker holds unstarted: freed by it, waited for."""
    policy = parts.policy_for_name(name)
    if policy is None or policy.unique is None:
        return
    messages = _looked_up(lambda: queued_messages_of(parts.app, name), name)
    for message in messages or ():
        _free_unique_key(parts, records, message, (cancel, fun))
    _await_freed_in_workers(parts, "task", name, (cancel, fun))


def _looked_up(look: Callable[[], _Found], what: str) -> _Found | None:
    """What ``look()`` found in the broker, or None when it failed (logged: the cancel
    is made, and a unique key it would free is freed when a worker discards the call)."""
    try:
        return look()
    except Exception as exc:
        logger.warning(
            "baton.cancel: could not look for %s in the broker (a unique key it holds is "
            "freed when a worker discards it): %s",
            what,
            exc,
        )
        return None


def _free_unique_key(
    parts: AppParts,
    records: Cancels,
    message: dict[str, Any],
    by_key: tuple[KeyCancel, Any] | None,
) -> None:
    """Free the unique key of the call ``message`` carries (``by_key``: only if that
    cancel by key, with the task's function, covers the call)."""
    found = _unique_key_of(parts, message, by_key)
    if found is None:
        return
    name, task_id, key = found
    records.free_held(key, task_id)
    logger.info(
        "baton: %s[%s] waits in the broker, cancelled: its unique key is freed", name, task_id
    )


def _unique_key_of(
    parts: AppParts, message: dict[str, Any], by_key: tuple[KeyCancel, Any] | None
) -> tuple[str, str, str] | None:
    """The task name, task id and unique key of the call ``message`` carries; None when
    it has no unique key (or ``by_key`` does not cover it)."""
    try:
        call = message_call(parts.app, message)
    except Exception as exc:  # a body this app cannot read: the worker's discard frees it
        logger.warning("baton.cancel: a queued message could not be read: %s", exc)
        return None
    if call is None:
        return None
    name, args, kwargs, headers = call
    task_id = str(headers.get("id"))
    if by_key is not None:
        cancel, fun = by_key
        sent_ms = stamp_time(headers.get(PUBLISH_HEADER))
        if covering(name, [cancel], {}, fun, args or (), kwargs or {}, sent_ms) is None:
            return None
    policy = delivery_policy(parts.policy_for_name(name), name, headers, parts.settings)
    if policy is None or policy.unique is None:
        return None
    try:
        return name, task_id, policy.unique_key(parts.names, args or (), kwargs or {})
    except BatonError as exc:
        logger.warning(
            "baton.cancel: %s[%s]: its unique key cannot be built: %s", name, task_id, exc
        )
        return None


def _await_freed_in_workers(
    parts: AppParts, header: str, value: str, by_key: tuple[KeyCancel, Any] | None = None
) -> None:
    """The unique calls (``header`` is ``value``: an id, or a task's name with
    ``by_key``) delivered to a worker and not started (in its prefetch, waiting for a
    pool process) keep their keys until that worker frees them: told by the cancel's
    notice, it frees the key of a call it has not started (worker/revoked_first.py).
    Wait for that, :data:`FREED_IN_A_WORKER_WAIT` at most, so that a publish after the
    cancel returned is a new run. A call that runs (``acks_late``) keeps its key until
    it ends: the wait runs out, said at DEBUG."""
    messages = _looked_up(lambda: delivered_messages(parts.app, header, value), value)
    held = [
        found
        for message in messages or ()
        if (found := _unique_key_of(parts, message, by_key)) is not None
    ]
    for name, task_id, _ in held:
        logger.info(
            "baton: %s[%s] is held by a worker, cancelled: its unique key is freed there",
            name,
            task_id,
        )
    deadline = time.monotonic() + FREED_IN_A_WORKER_WAIT
    try:
        while held:
            held = [(n, i, key) for n, i, key in held if parts.store.client.get(key) == i]
            if held and time.monotonic() >= deadline:
                for name, task_id, _ in held:
                    logger.debug(
                        "baton.cancel: %s[%s] keeps its unique key: it runs, or its "
                        "worker did not answer",
                        name,
                        task_id,
                    )
                return
            if held:
                time.sleep(0.005)
    except STORE_ERRORS as exc:
        logger.warning("baton.cancel: could not read a cancelled call's unique key: %s", exc)


def _cancel_key(
    parts: AppParts,
    records: Cancels,
    task: Any,
    key: Mapping[str, Any],
    *,
    terminate: bool,
    ttl: float,
) -> Cancelled:
    name = task if isinstance(task, str) else getattr(task, "name", None)
    if not isinstance(name, str) or not name:
        raise BatonError(f"baton.cancel: task= is a task or its name, got {task!r}")
    material = key_material(name, key)
    known = parts.app.tasks.get(name)
    spec = None
    if known is not None:  # a task of this app: its arguments are known, check the names
        spec = KeySpec.build(list(key), known.run, subject=f"baton.cancel({name})")
    else:
        # Kept: a publisher may send tasks by name without importing them. But a name
        # typed wrong cancels nothing, so say it (the CLI refuses such a name).
        logger.warning(
            "baton.cancel: %r is not a task of this app: its key's argument names are not "
            "checked, and a name typed wrong cancels nothing",
            name,
        )
    cut_ms = time.time_ns() // 1_000_000
    live = records.cancel_key(name, KeyCancel(cut_ms, material), ttl=ttl)
    # A call is cancelled when published at or before the cut, to the millisecond (its
    # publish stamp's): one published by this process after cancel() returned must be
    # stamped later, not in the same millisecond (CI saw one cancelled that way).
    while time.time_ns() // 1_000_000 <= cut_ms:
        time.sleep(0.0002)
    _free_queued_of_key(
        parts, records, name, KeyCancel(cut_ms, material), known.run if known else None
    )
    terminated: tuple[str, ...] = ()
    if terminate:
        terminated = _terminate_running(parts, name, material, spec)
    logger.info("baton: cancelled %s%s for %.0fs (%d live)", name, material, ttl, live)
    return Cancelled(f"{name} {material}", ttl, terminated=terminated)


def _terminate_running(
    parts: AppParts, name: str, material: str, spec: KeySpec | None
) -> tuple[str, ...]:
    """Revoke with terminate the running calls of ``name`` with this key, as the
    workers list them now (``inspect active``); a worker without remote control lists
    nothing and hears no revoke: it is told the key on the store's notice channel and
    stops its own (core/revoke_notices.py; not in what this returns)."""
    if spec is None:
        spec = KeySpec(name, None, tuple(_names(material)))
    active = parts.app.control.inspect(timeout=INSPECT_TIMEOUT).active() or {}
    ids = []
    for running in active.values():
        for entry in running or ():
            if entry.get("name") != name:
                continue
            try:
                if spec.material(entry.get("args") or (), entry.get("kwargs") or {}) == material:
                    ids.append(str(entry["id"]))
            except (KeySpecError, KeyError, TypeError):
                continue
    if ids:
        parts.app.control.revoke(ids, terminate=True)
    _tell_revoke(parts, {"terminate": True, KEY_ARG: [name, material]})
    return tuple(ids)


def _tell_revoke(parts: AppParts, arguments: dict[str, Any]) -> None:
    try:
        tell(parts.store, parts.names.notice_channel, arguments)
    except StoreUnavailable as exc:  # the broadcast went: workers without a mailbox miss it
        logger.warning(
            "baton.cancel: could not tell workers without remote control to terminate: %s", exc
        )


def _names(material: str) -> list[str]:
    return list(json.loads(material))


def _disabled(backend: Any) -> bool:
    """No result to mark here: none kept, or the rpc backend's, which only the caller
    that published reads (the worker that drops the call marks it)."""
    return type(backend).__name__ in ("DisabledBackend", "RPCBackend")
