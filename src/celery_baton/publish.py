"""The publish side: ``unique`` tasks are claimed when they are sent.

Every publish path ends in ``app.send_task``: ``delay``, ``apply_async``, sending by
name, canvas members (chain, group, chord) and beat. Wrapping it there covers all of
them at once. The claim uses the task id as owner, so a retry (same id) passes, and
a publish that fails gives its claim back. The claim's answer is read at the last
step before the broker, so nothing is sent until the claim is known.

Superseding publishes (supersede.py) are handled here too: an exclusive task under
``exclusive_conflict="replace"``/``"keep_last"`` gets its publish order in a header, and
a ``unique_conflict="replace"`` publish is sent first and then takes the key.

Every publish is stamped with a header of its own (``PUBLISH_HEADER``), which a copy
the broker redelivers carries unchanged: the redelivery guard refuses a copy of a
publish that ran, and runs a new publish of the same task id (``Task.replace``, a frozen
signature sent again, ``apply_async(task_id=...)``). A retry keeps its run's stamp: it
continues that publish, and a copy of the message it retried must not run after it.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from celery import current_task, states
from celery.backends.base import DisabledBackend
from celery.utils.time import maybe_iso8601, maybe_make_aware
from kombu.serialization import dumps, loads
from kombu.utils.uuid import uuid

from celery_baton import signals
from celery_baton.core.debounce import FlowKind
from celery_baton.core.keys import words
from celery_baton.core.policy import per_call
from celery_baton.core.policy.headers import (
    BEAT_SLOT_HEADER,
    CALL_HEADER,
    ORDER_HEADER,
    ORDERED_HEADER,
    PUBLISH_HEADER,
    UNKNOWN_TASK_HEADER,
    new_publish_stamp,
)
from celery_baton.core.policy.model import TaskPolicy
from celery_baton.core.policy.per_call import policy_for_call
from celery_baton.core.supersede import SUPERSEDED
from celery_baton.errors import (
    AlreadyQueued,
    ConfigError,
    KeySpecError,
    StoreUnavailable,
    TaskDeduplicated,
    TaskSuperseded,
)

if TYPE_CHECKING:
    from celery_baton.core.policy.model import TaskPolicy
    from celery_baton.parts import AppParts
    from celery_baton.store.scripts import Pending

logger = logging.getLogger("celery_baton.publish")


class _Duplicate(Exception):  # control flow inside one publish; never escapes it
    """Raised from the message sender when the claim found an earlier holder."""

    def __init__(self, holder: str) -> None:
        super().__init__(holder)
        self.holder = holder


@dataclass
class _Claim:
    """A unique claim written before the message is built, read before it is sent."""

    parts: AppParts
    key: str
    task_id: str
    ttl: float
    pending: Pending
    holder: str | None = None  # None: not read yet; '': claimed; else the holder's id
    failed: bool = False  # no answer: claim_result gives the claim back in the background

    def settle(self) -> str:
        if self.holder is None:
            try:
                self.holder = self.parts.unique.result(
                    self.pending, self.key, self.task_id, self.ttl
                )
            except BaseException:
                self.failed = True
                raise
        return self.holder

    def give_back(self) -> None:
        """After a publish that did not happen: free the key if this claim took it."""
        if self.failed:
            return
        try:
            if self.settle() != "":
                return
        except StoreUnavailable:
            return  # no answer: already being given back in the background
        try:
            self.parts.unique.release(self.key, self.task_id)
        except StoreUnavailable as exc:
            logger.warning("freeing unique key %s later: %s", self.key, exc)
            self.parts.unique.release_later(self.key, self.task_id, self.ttl)


CALL_OPTION = per_call.CALL_OPTION

_claims = threading.local()  # .by_id: claims of publishes in progress on this thread


def guard_send_task(parts: AppParts, send_task: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``app.send_task`` so that a unique task already queued is not queued again.

    The claim is written first and read just before the message goes to the broker
    (``_guard_sender``), so its round trip overlaps Celery building the message.
    """

    def send_unique_task(name: str, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        _stamp_publish(options)
        if "once" in options:
            _refuse_orphan_once(parts, name)
        policy = parts.policy_for_name(name)
        given = options.pop(CALL_OPTION, None)
        if policy is None and given is None and name not in parts.app.tasks:
            # Its options are unknown here: the worker says what that costs (a unique
            # claim not made at the publish).
            options["headers"] = {**(options.get("headers") or {}), UNKNOWN_TASK_HEADER: 1}
        if given is not None:
            # Validated here, before anything is sent; carried in a header, never in
            # the task's kwargs; overriding the task's options for this call only.
            call = per_call.parse(name, given)
            task = parts.app.tasks.get(name)
            if task is not None:  # a task of another app's code: its arguments are unknown
                per_call.check_arguments(name, given, task.run)
            per_call.check_against(name, call, policy)
            policy = policy_for_call(policy, name, call, parts.settings)
            options["headers"] = {**(options.get("headers") or {}), CALL_HEADER: call.to_header()}
        if policy is None or not policy.keys_at_publish:
            return send_task(name, args, kwargs, **options)
        # The keys built here are the keys the worker builds: over the arguments as it
        # reads them.
        key_args, key_kwargs = as_a_worker_reads(parts.app, name, args, kwargs, options)
        if policy.batch is not None:
            # A call its batch key cannot be read from fails here, not in a worker.
            policy.batch.material(name, key_args, key_kwargs)
        if policy.supersedes:
            _stamp_order(parts, name, policy, key_args, key_kwargs, options)
        if policy.ordered is not None:
            _check_ordered_call(name, options)
            if policy.unique is None:
                _stamp_place(parts, name, policy, key_args, key_kwargs, options)
        if policy.flow and policy.flow.kind is FlowKind.DEBOUNCE:
            key = policy.flow.store_key(parts.names, name, key_args, key_kwargs)
            return _send_debounced(parts, policy, send_task, name, args, kwargs, options, key)
        if policy.unique is None:
            return send_task(name, args, kwargs, **options)
        preassigned = options.get("task_id")
        task_id = preassigned or uuid()
        options["task_id"] = task_id
        key, material = policy.unique_key_and_material(parts.names, key_args, key_kwargs)
        # The call cannot run before it is due: its claim lasts unique_ttl from then.
        ttl = policy.unique_ttl + _due_in(options)
        expires = seconds_until(options.get("expires"))
        if expires is not None and 0 < expires < ttl:
            ttl = expires  # the call is dropped once expired: its claim lasts no longer
        if policy.unique_conflict == "replace":
            return _send_replacing(parts, send_task, name, args, kwargs, options, key, ttl)
        label = words(key, material)  # the key in words, for `locks` and the web view
        claim = _Claim(parts, key, task_id, ttl, parts.unique.send(key, task_id, ttl, label=label))
        if not _guard_sender(parts.app):
            claim.settle()  # no hook before the broker: know the answer before sending
        by_id = _claims.__dict__.setdefault("by_id", {})
        by_id[task_id] = claim
        try:
            if claim.holder:
                raise _Duplicate(claim.holder)
            if policy.ordered is not None:
                # A place is taken only for a call that is sent: a de-duplicated one
                # would leave a hole in its key's line (core/ordered.py).
                if claim.settle():
                    raise _Duplicate(claim.holder or "")
                _stamp_place(parts, name, policy, key_args, key_kwargs, options)
            return send_task(name, args, kwargs, **options)
        except _Duplicate as dup:
            holder = dup.holder
        except BaseException:
            claim.give_back()  # the message was not sent: nothing may keep its key
            raise
        finally:
            by_id.pop(task_id, None)
        # Out of the handler: an AlreadyQueued raised there would show the internal
        # _Duplicate as its context in the caller's traceback.
        return _deduplicated(
            parts, name, task_id, holder, key, preassigned, options, policy.unique_conflict
        )

    send_unique_task.__wrapped__ = send_task  # type: ignore[attr-defined]
    return send_unique_task


def _refuse_orphan_once(parts: AppParts, name: str) -> None:
    """``apply_async(..., once={...})`` left from celery-once on a task that is no longer
    a ``QueueOnce``: Celery carries the unknown option along and nobody reads it, so a
    call that raised ``AlreadyQueued`` (``graceful: False``) or had its own ``keys``
    silently queues a duplicate. Refused like ``once=`` on a declaration. A task of
    another app's code (not in this app) is left alone: its class is unknown here."""
    task = parts.app.tasks.get(name)
    if task is not None and not hasattr(task, "once"):
        raise ConfigError(
            "apply_async(once=...): `once` is celery-once's per-call option and does "
            "nothing without base=QueueOnce (celery-baton's is baton={...}: "
            '"unique", "unique_ttl", "unique_conflict"; docs/migration.md)',
            subject=name,
        )


def _stamp_publish(options: dict[str, Any]) -> None:
    """Name this publish in its headers (``PUBLISH_HEADER``), unless it is named already
    (the caller's own headers), or is a beat slot, which must run once whatever sends
    it: the beat may send one slot twice (policy/per_call.run_once)."""
    headers = options.get("headers") or {}
    if PUBLISH_HEADER in headers or BEAT_SLOT_HEADER in headers:
        return
    stamp = _retried_stamp(options)
    if stamp is None:  # its publish time: a cancel by key cancels calls published until it
        stamp = new_publish_stamp(time.time_ns() // 1_000_000, secrets.token_hex(6))
    options["headers"] = {**headers, PUBLISH_HEADER: stamp}


def _retried_stamp(options: dict[str, Any]) -> str | None:
    """The running task's stamp when this publish is its retry (``Task.retry``: its own
    id, one retry more, at the same replacement depth; ``Task.replace`` sends the same id
    one level deeper, as a new publish)."""
    if not _is_retry(options):
        return None
    stamp = getattr(current_task.request, PUBLISH_HEADER, None)
    return stamp if isinstance(stamp, str) else None


def _stamp_order(
    parts: AppParts,
    name: str,
    policy: TaskPolicy,
    args: Any,
    kwargs: Any,
    options: dict[str, Any],
) -> None:
    """Give a superseding exclusive publish its order (a header), from the store."""
    headers = dict(options.get("headers") or {})
    if ORDER_HEADER in headers:
        return
    task_id = options.get("task_id")
    task = current_task
    if task_id and task and task.request.id == task_id:  # (a proxy: falsy outside a task)
        # A retry (same task id): it keeps its place; a newer publish still wins.
        kept = getattr(task.request, ORDER_HEADER, None)
        if kept:
            options["headers"] = {**headers, ORDER_HEADER: kept}
            return
    try:
        order = parts.supersede.stamp(name, policy.exclusive_digest(args or (), kwargs or {}))
    except KeySpecError:
        return  # the worker refuses the message, with the reason
    except StoreUnavailable as exc:
        # Sent anyway: the gate gives it an order when it arrives (arrival, not publish,
        # then decides which of two such messages is newer).
        logger.warning("%s sent without a publish order: %s", name, exc)
        return
    options["headers"] = {**headers, ORDER_HEADER: order}


def _is_retry(options: dict[str, Any]) -> bool:
    """Whether this publish is the running task's retry (its own id, one retry more, at
    the same replacement depth: ``Task.replace`` sends the same id one level deeper)."""
    task_id = options.get("task_id")
    task = current_task
    if not task_id or not task:  # (a proxy: falsy outside a task)
        return False
    request = task.request
    if request.id != task_id or (options.get("retries") or 0) <= (request.retries or 0):
        return False
    return (options.get("replaced_task_nesting") or 0) == (request.replaced_task_nesting or 0)


def _check_ordered_call(name: str, options: dict[str, Any]) -> None:
    """An ordered call takes no eta or countdown: it would hold its key's whole line
    until it is due (or be skipped by the gap bound, and then refused). A retry's
    countdown is its own: it keeps its place, and the line waits for it."""
    if (options.get("eta") is not None or options.get("countdown") is not None) and not (
        _is_retry(options)
    ):
        raise ConfigError(
            "an ordered call takes no eta or countdown: it would hold every later call of "
            "its key until it is due; delay the publish instead (or use a task without "
            "ordered=)",
            subject=name,
        )


def _stamp_place(
    parts: AppParts,
    name: str,
    policy: TaskPolicy,
    args: Any,
    kwargs: Any,
    options: dict[str, Any],
) -> None:
    """Give an ordered call its place in its key's line (a header), from the store; a
    retry keeps its run's. Raises StoreUnavailable: sent without a place, the call
    would run out of order."""
    headers = dict(options.get("headers") or {})
    if ORDERED_HEADER in headers:
        return
    task = current_task
    if _is_retry(options) and task:
        kept = getattr(task.request, ORDERED_HEADER, None)
        if kept:
            options["headers"] = {**headers, ORDERED_HEADER: kept}
            return
    try:
        key_digest, material = policy.ordered_key(args or (), kwargs or {})
    except KeySpecError:
        return  # the worker refuses the message, with the reason
    place = parts.ordered.take(name, key_digest, material)
    options["headers"] = {**headers, ORDERED_HEADER: place.header()}


def _send_replacing(
    parts: AppParts,
    send_task: Callable[..., Any],
    name: str,
    args: Any,
    kwargs: Any,
    options: dict[str, Any],
    key: str,
    ttl: float,
) -> Any:
    """``unique_conflict="replace"``: send, then take the key from a queued holder (which
    then never runs). Sent first, so a publisher that dies in between loses nothing:
    both messages run."""
    result = send_task(name, args, kwargs, **options)
    task_id = options["task_id"]
    try:
        replaced = parts.supersede.replace(name, key, task_id, ttl)
    except StoreUnavailable as exc:
        logger.warning("%s[%s] sent without replacing the queued one: %s", name, task_id, exc)
        return result
    if replaced.status == SUPERSEDED:
        logger.info("%s[%s] replaces queued task %s", name, task_id, replaced.holder)
        superseded = TaskSuperseded(
            f"{name}[{replaced.holder}] was replaced by a newer publish, task {task_id}; "
            "it is not run",
            task_id,
        )
        backend = parts.app.backend
        try:  # a caller waiting on the old id is told at once (the worker says it too)
            if not isinstance(backend, DisabledBackend):  # no backend: nothing to tell
                backend.store_result(replaced.holder, superseded, states.REVOKED)
        except Exception:  # the result backend is optional
            logger.exception("could not record %s as superseded", replaced.holder)
    return result


def _send_debounced(
    parts: AppParts,
    policy: TaskPolicy,
    send_task: Callable[..., Any],
    name: str,
    args: Any,
    kwargs: Any,
    options: dict[str, Any],
    key: str,
) -> Any:
    """Send, THEN record the message as ``key``'s latest (see debounce.py): the store
    never names a message that was not sent, so a publisher killed in between loses
    nothing (the worker adopts the unrecorded message on arrival)."""
    assert policy.flow is not None
    options["task_id"] = options.get("task_id") or uuid()
    result = send_task(name, args, kwargs, **options)
    try:
        parts.debounces.record(policy.flow, key, options["task_id"])
    except StoreUnavailable as exc:
        # Sent already: the worker adopts it as the latest when it arrives.
        logger.warning("%s[%s] sent but not recorded for debounce: %s", name, result.id, exc)
    return result


def _guard_sender(app: Any) -> bool:
    """Make ``app.amqp.send_task_message`` read a publish's claim before it sends (and
    refuse to send a duplicate). False when this Celery has no such step."""
    amqp = app.amqp
    sender = getattr(amqp, "send_task_message", None)
    if sender is None:
        return False
    if getattr(sender, "_baton_guarded", False):
        return True

    def send_task_message(producer: Any, name: str, message: Any, **kwargs: Any) -> Any:
        by_id = getattr(_claims, "by_id", None)
        if by_id:
            claim = by_id.get(_message_id(message))
            if claim is not None and claim.settle():
                raise _Duplicate(claim.holder or "")
        return sender(producer, name, message, **kwargs)

    send_task_message._baton_guarded = True  # type: ignore[attr-defined]
    amqp.send_task_message = send_task_message
    return True


def _message_id(message: Any) -> Any:
    headers = getattr(message, "headers", None)
    if isinstance(headers, dict) and "id" in headers:  # task protocol 2
        return headers["id"]
    body = getattr(message, "body", None)
    return body.get("id") if isinstance(body, dict) else None  # protocol 1


def _deduplicated(
    parts: AppParts,
    name: str,
    task_id: str,
    holder: str,
    key: str,
    preassigned: str | None,
    options: dict[str, Any],
    conflict: str = "return",
) -> Any:
    logger.info(
        "%s not queued: an earlier one with the same unique key is queued or running as %s",
        name,
        holder,
    )
    signals.task_deduplicated.send(
        sender=name, name=name, task_id=task_id, existing_id=holder, key=key
    )
    if preassigned:
        _settle_preassigned(parts, name, task_id, holder, options)
    if conflict == "raise":  # celery-once's default: the caller is told, not handed a result
        raise AlreadyQueued(
            f"{name} not queued: task {holder} with the same unique key is queued or running",
            existing_id=holder,
            key=key,
        )
    result_cls = options.get("result_cls") or parts.app.AsyncResult
    return result_cls(holder)


def _settle_preassigned(
    parts: AppParts, name: str, task_id: str, holder: str, options: dict[str, Any]
) -> None:
    """Give ids that will never run a final state, so nothing waits on them forever.

    A caller that chose the id (a group or chord member, a chain's frozen ids) may wait
    on it rather than on the AsyncResult returned here: ``GroupResult.get()`` or the
    chain's last result would hang. Each such id gets a ``TaskDeduplicated`` failure
    that names the task that runs instead.
    """
    ids = [task_id]
    for sig in options.get("chain") or ():
        frozen = (sig.get("options") or {}).get("task_id") if isinstance(sig, dict) else None
        if frozen:
            ids.append(frozen)
    exc = TaskDeduplicated(
        f"{name} was not queued: task {holder} with the same unique key is queued or running",
        holder,
    )
    for dead_id in ids:
        try:
            parts.app.backend.mark_as_failure(dead_id, exc, call_errbacks=False)
        except Exception:  # the result backend is optional; its failure must not hide ours
            logger.exception("could not record %s as deduplicated", dead_id)


#: The argument types every serializer gives back as they were (exact types: a subclass,
#: an enum say, may come back as its base type).
_READ_AS_SENT = frozenset({str, int, float, bool, type(None)})


def as_a_worker_reads(
    app: Any, name: str, args: Any, kwargs: Any, options: dict[str, Any]
) -> tuple[Sequence[Any], Mapping[str, Any]]:
    """``args`` and ``kwargs`` as a worker reads them from the message: through the
    publish's serializer and back. json and msgpack read a tuple as a list and an enum
    as its value, so a key over ``"{pair}"`` would be ``(1, 2)`` here and ``[1, 2]`` in
    the worker: two keys, one claimed here and another freed there. Only the arguments
    of other types make the trip (one ``dumps`` and ``loads`` for them all); a call of
    str, int, float, bool and None alone costs a type check per argument."""
    args = args or ()
    kwargs = kwargs or {}
    at = [i for i, value in enumerate(args) if type(value) not in _READ_AS_SENT]
    named = [k for k, value in kwargs.items() if type(value) not in _READ_AS_SENT]
    if not at and not named:
        return args, kwargs
    serializer = options.get("serializer")
    if not serializer:
        task = app.tasks.get(name)
        serializer = getattr(task, "serializer", None) or app.conf.task_serializer
    try:
        content_type, encoding, data = dumps(  # type: ignore[no-untyped-call]
            [[args[i] for i in at], {k: kwargs[k] for k in named}], serializer=serializer
        )
        read_args, read_kwargs = loads(  # type: ignore[no-untyped-call]
            data, content_type, encoding, force=True
        )
    except Exception:  # Celery's own publish refuses it, with its message
        return args, kwargs
    read = list(args)
    for i, value in zip(at, read_args, strict=True):
        read[i] = value
    return read, {**kwargs, **read_kwargs}


def _due_in(options: dict[str, Any]) -> float:
    """Seconds until a publish's call is due (its ``countdown``, else its ``eta``, as
    Celery reads them); 0 for a call due now."""
    countdown = options.get("countdown")
    due = seconds_until(countdown if countdown else options.get("eta"))
    return max(0.0, due or 0.0)


def seconds_until(when: object) -> float | None:
    """A publish's ``expires`` (or ``eta``) in seconds from now, in every form Celery
    takes: seconds, or a datetime or its ISO text read as Celery's worker reads them
    (``maybe_iso8601``, naive ones as UTC); None for none (or text that is not a time:
    Celery refuses it)."""
    if isinstance(when, int | float) and not isinstance(when, bool):
        return float(when)
    if not when or not isinstance(when, str | datetime):
        return None
    try:
        moment: datetime = maybe_make_aware(maybe_iso8601(when))
    except ValueError:
        return None
    return float((moment - datetime.now(timezone.utc)).total_seconds())
