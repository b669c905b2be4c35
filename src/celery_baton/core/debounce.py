"""Debounce (trailing edge) and throttle (leading edge) of a task's runs. Celery-free.

**Debounce** ``debounce=5.0, debounce_key="doc_id"``: a burst of publishes for one key
runs once, ``debounce`` seconds after the last one, with the latest arguments;
``debounce_max_wait`` bounds how long a stream of publishes can postpone it.

Every message is sent at once (no countdown) and then recorded in the store as its
key's latest (debounce_record.lua). The worker's consumer asks the store for every
delivery (debounce_decide.lua): the latest waits in the consumer, costing no pool
slot, until the key was quiet for ``debounce`` (or ``max_wait`` passed since the
burst's first publish) on the store's clock, then runs; an older one is skipped as
superseded. Sending before recording means the store only ever names messages that
exist: a publisher killed between the two steps leaves a message the store does not
know, which the worker adopts as the latest on arrival. The run carries the ids it
stands for, and its outcome is written to each of them, so a superseded publish's
``AsyncResult`` resolves to the run that replaced it.

**Throttle** ``throttle=1.0, throttle_key="user_id"``: the first delivery of a quiet
key runs at once and opens a window; within it ``throttle_mode="drop"`` skips the
others, ``"trailing"`` keeps the newest and runs it when the window ends
(throttle_decide.lua). Decided at the worker alone: nothing to record at publish.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from celery_baton.core.keys import KeyNames, KeySpec, digest
from celery_baton.errors import ConfigError
from celery_baton.store.connection import STORE_ERRORS, Store

#: Its options are listed with every other in policy/options.py (TaskOptions).
NEEDS = {
    "debounce_key": "debounce",
    "debounce_max_wait": "debounce",
    "throttle_key": "throttle",
    "throttle_mode": "throttle",
}
THROTTLE_MODES = ("drop", "trailing")
#: How long the store remembers which run covered a task id (seconds, at least): a
#: copy of a superseded message delivered again later (a worker died holding it) must
#: still be skipped. Redis's default visibility timeout is one hour.
MIN_RETENTION = 3600.0


class FlowKind(enum.Enum):
    DEBOUNCE = "debounce"
    THROTTLE = "throttle"


@dataclass(frozen=True)
class FlowPolicy:
    """A task's debounce or throttle, compiled."""

    kind: FlowKind
    seconds: float  # debounce: the quiet time; throttle: the window
    key: KeySpec | None
    max_wait: float = 0.0  # debounce only; 0: unbounded
    mode: str = "drop"  # throttle only

    @property
    def retention(self) -> float:
        return max(MIN_RETENTION, 10 * max(self.seconds, self.max_wait))

    def store_key(
        self, names: KeyNames, task: str, args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> str:
        material = self.key.material(args, kwargs) if self.key else ""
        if self.kind is FlowKind.DEBOUNCE:
            return names.debounce(task, digest(material))
        return names.throttle(task, digest(material))

    def decide_call(self, key: str, task_id: str, channel: str) -> tuple[str, list[str], list[Any]]:
        """The script, KEYS and ARGV that decide one delivery."""
        retention = _ms(self.retention)
        if self.kind is FlowKind.DEBOUNCE:
            return (
                "debounce_decide",
                debounce_keys(key),
                [
                    task_id,
                    _ms(self.seconds),
                    _ms(self.max_wait) if self.max_wait else 0,
                    retention,
                    channel,
                ],
            )
        return (
            "throttle_decide",
            [key, f"{key}:ids"],
            [task_id, _ms(self.seconds), self.mode, retention, channel],
        )

    def started_call(self, key: str, task_id: str) -> tuple[str, list[str], list[Any]]:
        """The script, KEYS and ARGV that move a throttled run's window to its start,
        when its pool process starts it late (throttle_started.lua)."""
        assert self.kind is FlowKind.THROTTLE
        return (
            "throttle_started",
            [key],
            [task_id, _ms(self.seconds), _ms(self.retention)],
        )


def throttle_started(store: Store, keys: Sequence[str], args: Sequence[Any]) -> float:
    """throttle_started.lua (``FlowPolicy.started_call``): 0.0 when the run starts now
    (its window counts from now), else how long (s) until another run's window ends.
    Raises StoreUnavailable."""
    try:
        reply = store.scripts.call("throttle_started", keys, args)
    except STORE_ERRORS as exc:
        raise store.unavailable(exc) from exc
    return 0.0 if int(reply[0]) == 1 else max(int(reply[1]) / 1000, 0.001)


def debounce_keys(key: str) -> list[str]:
    return [key, f"{key}:ids", f"{key}:ran", f"{key}:ran0"]


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


class Outcome(enum.Enum):
    RUN = 1
    WAIT = 0
    SKIP = 2


@dataclass(frozen=True)
class FlowDecision:
    """What the store said about one delivery.

    RUN: ``stands_for`` are the superseded ids whose results this run writes; WAIT: ask
    again in ``delay`` seconds; SKIP: ``holder`` is the run that stands for this one.
    """

    outcome: Outcome
    delay: float = 0.0
    holder: str = ""
    stands_for: tuple[str, ...] = ()


def parse_decision(reply: Sequence[Any]) -> FlowDecision:
    """debounce_decide.lua's or throttle_decide.lua's reply."""
    outcome = Outcome(int(reply[0]))
    if outcome is Outcome.RUN:
        return FlowDecision(outcome, stands_for=tuple(_text(x) for x in reply[1:]))
    if outcome is Outcome.WAIT:
        return FlowDecision(outcome, delay=int(reply[1]) / 1000)
    return FlowDecision(outcome, holder=_text(reply[1]))


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Debounces:
    """The publish side: record a sent message as its key's latest."""

    def __init__(self, store: Store, names: KeyNames) -> None:
        self.store = store
        self.names = names

    def record(self, policy: FlowPolicy, key: str, task_id: str) -> bool:
        """Record ``task_id`` (already sent) as ``key``'s latest; raises StoreUnavailable.
        False: the store knew it already (a worker adopted it first)."""
        try:
            return bool(
                self.store.scripts.call(
                    "debounce_record",
                    debounce_keys(key),
                    [task_id, _ms(policy.retention), self.names.notice_channel],
                )
            )
        except STORE_ERRORS as exc:
            raise self.store.unavailable(exc) from exc


def compile_flow(
    name: str,
    options: Callable[[str], Any],
    spec: Callable[[str], KeySpec | None],
) -> FlowPolicy | None:
    """Validate the debounce/throttle options of task ``name``; None when it has none."""
    for option, needed in NEEDS.items():
        if options(option) is not None and options(needed) is None:
            raise ConfigError(f"{option} needs {needed}", subject=name)
    debounce, throttle = options("debounce"), options("throttle")
    if debounce is not None and throttle is not None:
        raise ConfigError(
            "debounce and throttle together: choose one (debounce runs the last of a "
            "burst, throttle the first)",
            subject=name,
        )
    if debounce is None and throttle is None:
        return None
    if options("unique") is not None:
        raise ConfigError(
            "unique with debounce or throttle: unique would return the first publish, so "
            "the later arguments could never win; debounce already runs a key once",
            subject=name,
        )
    if debounce is not None:
        seconds = _seconds(debounce, f"{name}.debounce")
        max_wait = 0.0
        if options("debounce_max_wait") is not None:
            max_wait = _seconds(options("debounce_max_wait"), f"{name}.debounce_max_wait")
            if max_wait < seconds:
                raise ConfigError(
                    f"must be >= debounce ({seconds:g}s), got {max_wait:g}s: a burst could "
                    "never be quiet for debounce before max_wait cut it",
                    subject=f"{name}.debounce_max_wait",
                )
        return FlowPolicy(FlowKind.DEBOUNCE, seconds, spec("debounce_key"), max_wait=max_wait)
    mode = options("throttle_mode") or "drop"
    if mode not in THROTTLE_MODES:
        raise ConfigError(
            f"must be one of {THROTTLE_MODES}, got {mode!r}", subject=f"{name}.throttle_mode"
        )
    return FlowPolicy(
        FlowKind.THROTTLE, _seconds(throttle, f"{name}.throttle"), spec("throttle_key"), mode=mode
    )


def _seconds(value: Any, subject: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigError(f"must be a number of seconds > 0, got {value!r}", subject=subject)
    if value == float("inf"):
        raise ConfigError("must be finite", subject=subject)
    return float(value)
