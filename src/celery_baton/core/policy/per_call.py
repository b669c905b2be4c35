"""Per-call options: the caller decides a call's key and policy; and the policy one
call or delivery runs under (a call's options, a beat slot's run-once). Celery-free.

One task is often called under different policies (seed 004: the caller picks the lock
key, whether a duplicate waits or is rejected, and how long it may wait). They travel in
the message, as a header, under one keyword::

    import_feed.apply_async(
        (url,), baton={"exclusive": "tenant:42", "conflict": "wait", "wait_timeout": 30}
    )

Why ``baton={...}``: Celery's idiom for per-call settings is a keyword of
``apply_async`` (``countdown=``, ``expires=``, ``priority=``), and celery-once's is
``once={...}``; one namespaced dict keeps ours apart from Celery's own options and from
the task's arguments (the seed popped its options out of ``kwargs``; we never put them
there). It works wherever options do: ``apply_async``, ``signature(...).set()``, canvas
members, ``send_task`` and beat entries' ``options``.

Validated at publish (a typo raises there, before anything is sent) and read again by
the worker from the header.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from celery_baton.config import Settings, suggest
from celery_baton.core.keys import KeySpec, _canonical_json
from celery_baton.core.policy.model import TaskPolicy
from celery_baton.core.policy.options import CONFLICT_POLICIES, UNIQUE_CONFLICTS, is_seconds
from celery_baton.errors import ConfigError

#: The keyword of apply_async/send_task/signature options (and of a beat entry's
#: ``options``) that carries per-call options.
CALL_OPTION = "baton"
#: How long a worker remembers that a beat slot ran (seconds). A slot is sent twice
#: only when a leader's publish stalled past its lease, and its copy lands when the
#: broker comes back: a day covers any such stall, in one key per entry (slot_runs.py;
#: one small key per slot for a trigger or a message of an older beat).
BEAT_SLOT_RETENTION = 24 * 3600.0


@dataclass(frozen=True)
class CallOptions:
    """What one call overrides of its task's declared options (None: the task's own)."""

    exclusive: str | None = None  # the key's material, canonical (see key_material)
    conflict: str | None = None  # "skip" | "wait" | "replace" | "keep_last"
    wait_timeout: float | None = None  # seconds a "wait" duplicate may be held at most
    lease_ttl: float | None = None
    unique: str | None = None  # the unique key's material
    unique_conflict: str | None = None  # "return" | "raise" | "replace"
    unique_ttl: float | None = None

    def to_header(self) -> str:
        return json.dumps(
            {f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not None}
        )

    @classmethod
    def from_header(cls, text: str | None) -> CallOptions | None:
        """A header written by :meth:`to_header` (trusted: it was validated at publish)."""
        if not text:
            return None
        return cls(**json.loads(text))


NAMES = tuple(f.name for f in fields(CallOptions))
#: A task option's name given per call, where the per-call option is named otherwise
#: (per call, ``exclusive`` is given beside it): said, not taken silently.
AS_TASK_OPTIONS = {"exclusive_conflict": "conflict", "exclusive_wait_timeout": "wait_timeout"}


def _hint(name: str) -> str:
    if name in AS_TASK_OPTIONS:
        return f" (per call it is `{AS_TASK_OPTIONS[name]}`)"
    return suggest(name, NAMES)


def key_material(value: object, *, subject: str) -> str:
    """A per-call key: a string is used as given; a mapping of argument names to values
    is written exactly as a declared key over those names writes it, so
    ``baton={"exclusive": {"tenant": 42}}`` and ``exclusive="tenant"`` called with
    ``tenant=42`` name the same key."""
    if isinstance(value, str):
        if not value:
            raise ConfigError("a per-call key must not be empty", subject=subject)
        return value
    if isinstance(value, Mapping) and value and all(isinstance(k, str) for k in value):
        try:
            return str(_canonical_json(dict(value)))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"cannot be made into a key: {exc}", subject=subject) from exc
    raise ConfigError(
        f"a per-call key is a string or a mapping of argument names, got {value!r}",
        subject=subject,
    )


def parse(task: str, value: object) -> CallOptions:
    """Validate the ``baton={...}`` of one call of ``task``; raise ConfigError naming it."""
    subject = f"{task} baton="
    if not isinstance(value, Mapping):
        raise ConfigError(f"expected a dict of options, got {value!r}", subject=subject)
    unknown = [f"{name!r}{_hint(str(name))}" for name in value if name not in NAMES]
    if unknown:  # every typo at once
        plural = "s" if len(unknown) > 1 else ""
        raise ConfigError(f"unknown per-call option{plural} {'; '.join(unknown)}", subject=subject)

    def choice(name: str, allowed: tuple[str, ...]) -> str | None:
        option = value.get(name)
        if option is not None and option not in allowed:
            hint = suggest(option, allowed) if isinstance(option, str) else ""
            raise ConfigError(
                f"{name} must be one of {allowed}, got {option!r}{hint}", subject=subject
            )
        return option if option is None else str(option)

    def seconds(name: str) -> float | None:
        option = value.get(name)
        if option is None:
            return None
        if not is_seconds(option):  # "wait forever" is no wait_timeout: leave it out
            raise ConfigError(
                f"{name} must be seconds > 0 and finite, got {option!r}",
                subject=subject,
            )
        return float(option)

    def key(name: str) -> str | None:
        option = value.get(name)
        return None if option is None else key_material(option, subject=f"{subject}{name}")

    if value.get("conflict") in ("replace", "skip") and value.get("wait_timeout") is not None:
        raise ConfigError(
            f'wait_timeout does nothing with conflict="{value.get("conflict")}" (nothing '
            'waits); use "wait" or "keep_last" for a bounded wait',
            subject=subject,
        )
    return CallOptions(
        exclusive=key("exclusive"),
        conflict=choice("conflict", CONFLICT_POLICIES),
        wait_timeout=seconds("wait_timeout"),
        lease_ttl=seconds("lease_ttl"),
        unique=key("unique"),
        unique_conflict=choice("unique_conflict", UNIQUE_CONFLICTS),
        unique_ttl=seconds("unique_ttl"),
    )


def check_arguments(task: str, value: Mapping[str, Any], fun: Callable[..., Any]) -> None:
    """A per-call key given as a mapping names arguments of the task, as a declared key
    does: one that the task does not take (``{"urll": ...}``) is refused as there."""
    for name in ("exclusive", "unique"):
        option = value.get(name)
        if isinstance(option, Mapping) and option:
            KeySpec.build(list(option), fun, subject=f"{task} baton={name}")


def check_against(task: str, options: CallOptions, declared: Any) -> None:
    """Refuse per-call options that qualify what the task does not have (a ``conflict``
    for a task that is not exclusive and names no per-call key): they would do nothing.
    ``declared`` is the task's compiled policy or None."""
    subject = f"{task} baton="
    if getattr(declared, "ordered", None) is not None:
        given = [
            name
            for name in ("exclusive", "conflict", "wait_timeout")
            if getattr(options, name) is not None
        ]
        if given:
            # ordered= holds its key's lease itself: another key, or a conflict policy,
            # would stall its line or run a call out of turn (compile.py's refusal).
            raise ConfigError(
                f"{', '.join(given)} cannot be given to an ordered task (ordered= runs one "
                "call of its key at a time, in publish order)",
                subject=subject,
            )
    exclusive = options.exclusive is not None or getattr(declared, "exclusive", None)
    unique = options.unique is not None or getattr(declared, "unique", None)
    conflict = options.conflict or getattr(declared, "exclusive_conflict", None) or "skip"
    if options.wait_timeout is not None and conflict in ("skip", "replace"):
        raise ConfigError(
            f'wait_timeout does nothing with exclusive_conflict="{conflict}" (nothing '
            'waits); add conflict="wait" (or "keep_last") to this call',
            subject=subject,
        )
    for name, needs, present in (
        ("conflict", "exclusive", exclusive),
        ("wait_timeout", "exclusive", exclusive),
        ("unique_conflict", "unique", unique),
        ("unique_ttl", "unique", unique),
    ):
        if getattr(options, name) is not None and not present:
            raise ConfigError(
                f"{name} needs {needs} (declared on the task or given in this call)",
                subject=subject,
            )


def for_call(policy: TaskPolicy, call: CallOptions) -> TaskPolicy:
    """This policy as one call's per-call options override it (that call only)."""
    return replace(
        policy,
        exclusive=policy.exclusive or (_PER_CALL if call.exclusive is not None else None),
        call_exclusive=call.exclusive,
        exclusive_conflict=call.conflict or policy.exclusive_conflict,
        exclusive_wait_timeout=call.wait_timeout or policy.exclusive_wait_timeout,
        lease_ttl=call.lease_ttl or policy.lease_ttl,
        unique=policy.unique or (_PER_CALL if call.unique is not None else None),
        call_unique=call.unique,
        unique_conflict=call.unique_conflict or policy.unique_conflict,
        unique_ttl=call.unique_ttl or policy.unique_ttl,
    )


#: The key spec of an option that only a call gives (its material comes with the call).
_PER_CALL = KeySpec("per-call", None, (), whole_task=True)


def policy_for_call(
    policy: TaskPolicy | None, name: str, call: CallOptions, settings: Settings
) -> TaskPolicy:
    """The policy one call runs under: the task's (or none) with the call's options."""
    if policy is None:
        policy = TaskPolicy(
            name=name,
            lease_ttl=settings.lease_ttl,
            unique_ttl=settings.unique_ttl,
            redelivery_guard=settings.redelivery_guard,
            redelivery_retention=settings.redelivery_retention,
        )
    return for_call(policy, call)


def run_once(policy: TaskPolicy | None, name: str, settings: Settings) -> TaskPolicy:
    """``policy`` (or no policy at all) with the redelivery guard on: how a worker admits
    a beat slot. A broker cannot be fenced, so a slot may be *sent* twice (a stalled
    publish lands after the next leader re-sent it, under the same task id); the guard's
    run lease and done marker make it *run* once, whatever the task's own options and
    ``baton_redelivery_guard`` say."""
    if policy is None:
        return TaskPolicy(
            name=name,
            lease_ttl=settings.lease_ttl,
            redelivery_guard=True,
            redelivery_retention=BEAT_SLOT_RETENTION,
        )
    retention = max(policy.redelivery_retention, BEAT_SLOT_RETENTION)
    if policy.redelivery_guard and policy.redelivery_retention == retention:
        return policy
    return replace(policy, redelivery_guard=True, redelivery_retention=retention)
