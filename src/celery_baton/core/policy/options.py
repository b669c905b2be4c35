"""The task options celery-baton reads: their names, types and allowed values, written
once. Celery-free.

``TaskOptions`` is the one list: ``TASK_OPTIONS`` (what a typo is checked against) is
read from it, and the allowed values of a choice are read from its ``Literal``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal, TypedDict, get_args

from celery_baton.config import suggest
from celery_baton.core.keys import KeySpecValue
from celery_baton.errors import ConfigError

ExclusiveConflict = Literal["skip", "wait", "replace", "keep_last"]
UniqueConflict = Literal["return", "raise", "replace"]
UniqueUntil = Literal["finished", "started"]
ThrottleMode = Literal["drop", "trailing"]


class TaskOptions(TypedDict, total=False):
    """The task options in a form an IDE and mypy can check::

    @app.task(**TaskOptions(exclusive="feed_url", exclusive_conflict="wait"))

    Every option celery-baton reads (documented in docs/configuration.md).
    """

    exclusive: KeySpecValue
    exclusive_conflict: ExclusiveConflict
    exclusive_wait_timeout: float
    unique: KeySpecValue
    unique_conflict: UniqueConflict
    unique_until: UniqueUntil
    unique_ttl: float
    global_rate_limit: str | float | list[str | float]
    global_rate_limit_key: KeySpecValue
    global_rate_limit_burst: int
    global_concurrency: int
    global_concurrency_key: KeySpecValue
    lease_ttl: float
    redelivery_guard: bool
    expected_runtime: float
    fair_key: KeySpecValue
    fair_weights: Mapping[Any, float] | Callable[[Any], float]
    limits: str | list[str]
    cost: float | Callable[..., float]
    debounce: float
    debounce_key: KeySpecValue
    debounce_max_wait: float
    throttle: float
    throttle_key: KeySpecValue
    throttle_mode: ThrottleMode
    ordered: KeySpecValue
    ordered_gap_timeout: float
    batch: KeySpecValue
    batch_size: int
    batch_wait: float


#: Every task option celery-baton reads, in TaskOptions' order.
TASK_OPTIONS: tuple[str, ...] = tuple(TaskOptions.__annotations__)

CONFLICT_POLICIES: tuple[str, ...] = get_args(ExclusiveConflict)
UNIQUE_CONFLICTS: tuple[str, ...] = get_args(UniqueConflict)
UNIQUE_UNTIL: tuple[str, ...] = get_args(UniqueUntil)
#: Exclusive policies under which a newer publish supersedes an older one (supersede.py).
SUPERSEDING = ("replace", "keep_last")

#: Options that only mean something beside another one (debounce.py checks its own).
NEEDS = {
    "exclusive_conflict": "exclusive",
    "exclusive_wait_timeout": "exclusive",
    "unique_conflict": "unique",
    "unique_until": "unique",
    "unique_ttl": "unique",
    "global_rate_limit_burst": "global_rate_limit",
    "global_rate_limit_key": "global_rate_limit",
    "global_concurrency_key": "global_concurrency",
    "fair_weights": "fair_key",
    "cost": "limits",
    "ordered_gap_timeout": "ordered",
    "batch_size": "batch",
    "batch_wait": "batch",
}


def is_seconds(value: object) -> bool:
    """A duration option's value: a number of seconds > 0 and finite (forever is
    leaving the option out, or a bug)."""
    return (
        not isinstance(value, bool)
        and isinstance(value, int | float)
        and value > 0
        and not math.isinf(value)
    )


def declares_options(options: Mapping[str, Any]) -> bool:
    return any(options.get(name) is not None for name in TASK_OPTIONS)


def check_option_names(name: str, options: Mapping[str, Any], others: Iterable[str]) -> None:
    """A task option that is not ours but close to one of ours is a typo
    (``exclusiv="feed_url"``): refuse it with a suggestion, every such option at once.
    ``others``: names that are somebody else's (Celery's own task attributes and publish
    options, the task's base class's attributes, other extensions' options)."""
    others = set(others)
    typos = []
    for option in options:
        if option in TASK_OPTIONS or option in others:
            continue
        if option == "fair":  # fair=True says fair, but not by what
            typos.append(
                "`fair`: name the key that shares the limit fairly, e.g. fair_key='tenant' "
                "(did you mean `fair_key`?)"
            )
            continue
        hint = suggest(option, TASK_OPTIONS)
        if hint:
            typos.append(f"`{option}`{hint}")
    if typos:
        plural = "s" if len(typos) > 1 else ""
        raise ConfigError(f"unknown task option{plural} {'; '.join(typos)}", subject=name)
