"""Compile a task's options into its ``TaskPolicy``, once: validate them, and refuse
with the task's name what cannot work. Celery-free.

Reads the options as plain attributes (Celery stores ``@app.task(**options)`` on the task
class) through ``options(name)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from celery_baton.config import Settings, suggest
from celery_baton.core import debounce
from celery_baton.core.batch import any_call, check_batch_cost, compile_batch
from celery_baton.core.fairness import FairPolicy, check_weights
from celery_baton.core.keys import KeySpec, KeySpecValue
from celery_baton.core.policy.model import ConcurrencyPolicy, RatePolicy, TaskPolicy
from celery_baton.core.policy.options import (
    CONFLICT_POLICIES,
    NEEDS,
    SUPERSEDING,
    UNIQUE_CONFLICTS,
    UNIQUE_UNTIL,
    is_seconds,
)
from celery_baton.core.rates import check_celery_rate, parse_burst, parse_rate
from celery_baton.core.shared_limits import SharedLimit, parse_limits, resolve
from celery_baton.errors import ConfigError


def compile_policy(
    name: str,
    options: Callable[[str], Any],
    fun: Callable[..., Any],
    settings: Settings,
    *,
    bound: bool = False,
) -> TaskPolicy | None:
    """Validate a task's options; ``None`` when it asks for nothing.

    ``options(name)`` reads one option (``getattr`` on the task, or a dict lookup at
    declaration time); ``fun`` is the function whose signature keys are bound to.
    """

    # A batched body takes the list of calls: its other keys (a per-key limit, the fair
    # key) are read from a call's arguments, as its batch key is.
    batched = options("batch") is not None and options("batch") is not False
    keyed, keyed_bound = (any_call, False) if batched else (fun, bound)

    def spec(option: str) -> KeySpec | None:
        value: KeySpecValue | None = options(option)
        if value is None or value is False:
            return None
        return KeySpec.build(value, keyed, subject=f"{name}.{option}", bound=keyed_bound)

    def choice(option: str, allowed: tuple[str, ...], default: str | None = None) -> str:
        value = options(option)
        value = (default or allowed[0]) if value is None else value
        if value not in allowed:
            hint = suggest(value, allowed) if isinstance(value, str) else ""
            raise ConfigError(
                f"must be one of {allowed}, got {value!r}{hint}", subject=f"{name}.{option}"
            )
        return str(value)

    def seconds(option: str, default: float) -> float:
        value = options(option)
        if value is None:
            return default
        if not is_seconds(value):
            raise ConfigError(
                f"must be a number of seconds > 0 and finite, got {value!r}",
                subject=f"{name}.{option}",
            )
        return float(value)

    ordered = _ordered(name, options, spec)  # first: its refusals name it
    for option, needed in NEEDS.items():
        if options(option) is not None and options(needed) is None:
            raise ConfigError(f"{option} needs {needed}", subject=name)
    # Before the other keys are built: what a batch refuses is said as such, not as a key
    # naming an argument its body (which takes the calls) lacks.
    batch = compile_batch(name, options, fun, bound=bound)

    rate = None
    more_rates: tuple[RatePolicy, ...] = ()
    if options("global_rate_limit") is not None:
        subject = f"{name}.global_rate_limit"
        burst = parse_burst(
            1 if options("global_rate_limit_burst") is None else options("global_rate_limit_burst"),
            subject=f"{subject}_burst",
        )
        key = spec("global_rate_limit_key")
        limits = options("global_rate_limit")
        if isinstance(limits, list | tuple):
            if not limits:
                raise ConfigError("an empty list of rates", subject=subject)
            rates = [parse_rate(x, subject=f"{subject}[{i}]") for i, x in enumerate(limits)]
            if len(set(rates)) != len(rates):
                raise ConfigError(f"the same rate twice in {limits!r}", subject=subject)
        else:
            rates = [parse_rate(limits, subject=subject)]
        rate = RatePolicy(rates[0], burst, key)
        more_rates = tuple(RatePolicy(r, burst, key) for r in rates[1:])

    concurrency = None
    limit = options("global_concurrency")
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ConfigError(
                f"must be an int >= 1, got {limit!r}", subject=f"{name}.global_concurrency"
            )
        concurrency = ConcurrencyPolicy(limit, spec("global_concurrency_key"))

    fair = _fair_policy(name, options, spec)
    shared = _shared_limits(name, options, settings)
    flow = debounce.compile_flow(name, options, spec)
    if batch is not None:
        check_batch_cost(name, batch, options("cost"), shared)

    if options("exclusive_wait_timeout") is not None and (
        options("exclusive_conflict") or "skip"
    ) in ("replace", "skip"):
        # "skip" drops a duplicate at once, "replace" stops the old run: nothing waits.
        raise ConfigError(
            "exclusive_wait_timeout does nothing with exclusive_conflict="
            f'"{options("exclusive_conflict") or "skip"}" (nothing waits); use "wait" or '
            '"keep_last" for a bounded wait',
            subject=name,
        )
    conflict = options("exclusive_conflict")
    if (
        conflict in SUPERSEDING
        and options("unique") is not None
        and options("unique") == options("exclusive")
        and options("unique_until") != "started"
        and options("unique_conflict") != "replace"
    ):
        # The newer publish would be dropped at publish: it could never supersede.
        raise ConfigError(
            f'exclusive_conflict="{conflict}" with unique on the same key: a newer publish '
            "is de-duplicated before it can supersede the older one; add "
            'unique_conflict="replace" (or unique_until="started", or drop unique)',
            subject=name,
        )
    guard = options("redelivery_guard")
    if settings.global_rate_limits and options("rate_limit"):
        check_celery_rate(options("rate_limit"), subject=f"{name}.rate_limit")
        parse_rate(options("rate_limit"), subject=f"{name}.rate_limit")
    policy = TaskPolicy(
        name=name,
        lease_ttl=seconds("lease_ttl", settings.lease_ttl),
        # ordered= holds its key's exclusive lease itself (same key, checked above); a
        # call whose turn came waits for a lease still held (a copy of itself running).
        exclusive=None if ordered else spec("exclusive"),
        exclusive_conflict="wait" if ordered else choice("exclusive_conflict", CONFLICT_POLICIES),
        exclusive_wait_timeout=(
            seconds("exclusive_wait_timeout", 1.0)
            if options("exclusive_wait_timeout") is not None
            else None
        ),
        unique=spec("unique"),
        unique_conflict=choice("unique_conflict", UNIQUE_CONFLICTS, settings.unique_conflict),
        unique_until=choice("unique_until", UNIQUE_UNTIL),
        unique_ttl=seconds("unique_ttl", settings.unique_ttl),
        rate=rate,
        more_rates=more_rates,
        # Every task, not only those declared with a rate_limit: `celery control
        # rate_limit` can give any task one at runtime, and Celery's own bucket is off.
        rate_from_celery=settings.global_rate_limits and rate is None,
        concurrency=concurrency,
        redelivery_guard=settings.redelivery_guard if guard is None else bool(guard),
        redelivery_retention=settings.redelivery_retention,
        fair=fair,
        shared=shared,
        cost=options("cost"),
        flow=flow,
        ordered=ordered,
        ordered_gap=seconds("ordered_gap_timeout", settings.ordered_gap_timeout),
        batch=batch,
    )
    if not (policy.gates_runs or policy.unique or policy.batch):
        return None
    return policy


def _ordered(
    name: str,
    options: Callable[[str], Any],
    spec: Callable[[str], KeySpec | None],
) -> KeySpec | None:
    """``ordered=``, refused with what cannot work beside it: it holds its key's
    exclusive lease itself, and every call must run (or be refused by its rule), so
    nothing may drop or merge calls of its line."""
    if options("ordered") is not None and options("batch") is not None:
        # Before the key is built: a batched body takes ``calls``, not the key's name.
        raise ConfigError(
            "batch cannot be used with ordered=: not yet: a batch runs many calls of a key "
            "at once, ordered= one at a time",
            subject=f"{name}.ordered",
        )
    key = spec("ordered")
    if key is None:
        return None
    subject = f"{name}.ordered"
    exclusive = options("exclusive")
    if exclusive is not None and exclusive is not False and exclusive != options("ordered"):
        raise ConfigError(
            "ordered= runs one call of its key at a time already; exclusive= on another "
            "key would hold a call whose turn came behind another key's run, and its line "
            "with it: drop exclusive (or make it the same key)",
            subject=subject,
        )
    for option, why in (
        ("exclusive_conflict", "a call of an ordered key always waits for its turn"),
        (
            "exclusive_wait_timeout",
            "a call waits for its turn; ordered_gap_timeout bounds "
            "how long a missing one holds the key",
        ),
        ("debounce", "debounce drops calls, which would leave holes in the key's line"),
        ("throttle", "throttle drops calls, which would leave holes in the key's line"),
    ):
        if options(option) is not None:
            raise ConfigError(f"{option} cannot be used with ordered=: {why}", subject=subject)
    if options("unique") is not None and options("unique_conflict") == "replace":
        raise ConfigError(
            'unique_conflict="replace" cannot be used with ordered=: a replaced call never '
            "runs, and its place would hold the key until the gap bound",
            subject=subject,
        )
    return key


def _fair_policy(
    name: str, options: Callable[[str], Any], spec: Callable[[str], KeySpec | None]
) -> FairPolicy | None:
    """``fair_key`` (and ``fair_weights``): one shared limit, shared fairly by the key's
    values. A per-key limit (``global_concurrency_key``) is a cap of each key's own;
    ``fair_key`` shares one cap among keys, so it needs a limit to share."""
    if options("fair_key") is None:
        return None
    if options("global_concurrency") is None and options("global_rate_limit") is None:
        raise ConfigError(
            "fair_key shares a limit fairly: it needs global_concurrency or global_rate_limit",
            subject=name,
        )
    key = spec("fair_key")
    if key is None or key.whole_task:
        raise ConfigError(
            "fair_key must name what the limit is shared by (an argument name, a list, "
            "a '{template}' or a callable), not True/False",
            subject=f"{name}.fair_key",
        )
    return FairPolicy(key, check_weights(options("fair_weights"), f"{name}.fair_weights"))


def _shared_limits(
    name: str, options: Callable[[str], Any], settings: Settings
) -> tuple[SharedLimit, ...]:
    """A task's ``limits=`` and ``cost=``, checked against ``baton_limits`` when known
    (at worker start always; at declaration when the app's conf already has them)."""
    wanted, cost = options("limits"), options("cost")
    if cost is not None and not callable(cost):
        SharedLimit("-", 1.0, 1 << 62).check_cost(cost, subject=f"{name}.cost")
    if wanted is None or settings.limits is None:
        return ()
    table = parse_limits(settings.limits)
    shared = resolve(table, wanted, subject=f"{name}.limits")
    if cost is not None and not callable(cost):
        for limit in shared:
            limit.check_cost(cost, subject=f"{name}.cost")
    return shared
