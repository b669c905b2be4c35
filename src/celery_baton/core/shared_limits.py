"""Named limits shared by several tasks and by code: ``baton_limits``. Celery-free.

``app.conf.baton_limits = {"openai": "90000/m"}`` declares a budget; every task that
says ``limits=["openai"]`` and every ``baton.limit("openai")`` in code draw from the
same one. A call may weigh more than one (``cost=``: tokens, rows, bytes): GCRA with
weights, a call of cost ``n`` spends ``n`` emission intervals.

A named limit's burst defaults to its whole period's count (``"90000/m"`` holds 90000:
a provider's "tokens per minute" is a bucket of a minute's tokens that refills
continuously), unlike a task's own ``global_rate_limit`` (burst 1, spacing runs).
``{"rate": "90000/m", "burst": 9000}`` sets it. A cost above the burst could never
pass: it is an error when declared (a number) or a refusal when asked (a callable).

``penalize(seconds)`` holds every admission under the limit, on every worker, until
the penalty ends (a 429 with ``Retry-After`` seen by one of them).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from celery_baton.config import suggest
from celery_baton.core.conditions import Condition, Penalty, WeightedRate
from celery_baton.core.gate import Decision, Gate
from celery_baton.core.keys import KeyNames
from celery_baton.core.rates import interval_us, parse_burst, parse_rate
from celery_baton.errors import ConfigError, CostError, LimitTimeout

#: The keys of a named limit given as a mapping.
LIMIT_FIELDS = ("rate", "burst")
_COUNT_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)")

Cost = float | int | Callable[..., Any]


@dataclass(frozen=True)
class SharedLimit:
    """One named limit: ``per_second`` with a bucket of ``burst`` (cost units)."""

    name: str
    per_second: float
    burst: int

    @property
    def interval_us(self) -> int:
        return interval_us(self.per_second)

    @property
    def tolerance_us(self) -> int:
        return self.burst * self.interval_us

    def increment_us(self, cost: float) -> int:
        return round(cost * self.interval_us)

    def check_cost(self, cost: object, *, subject: str) -> float:
        """``cost`` as a number this limit can admit, else CostError (never a stall)."""
        if isinstance(cost, bool) or not isinstance(cost, int | float) or not cost >= 0:
            raise CostError(f"a cost must be a number >= 0, got {cost!r}", subject=subject)
        if not math.isfinite(cost):
            raise CostError(f"a cost must be finite, got {cost!r}", subject=subject)
        if cost > self.burst:
            raise CostError(
                f"cost {cost:g} is larger than the burst {self.burst} of limit "
                f"{self.name!r}: it could never be admitted (raise its burst: "
                f'{{"rate": ..., "burst": {math.ceil(cost)}}})',
                subject=subject,
            )
        return float(cost)

    def conditions(self, names: KeyNames, cost: float) -> list[Condition]:
        """The gate conditions of one call of ``cost`` (checked): penalty, then rate."""
        return [
            Penalty(names.shared_penalty(self.name)),
            WeightedRate(names.shared_rate(self.name), self.increment_us(cost), self.tolerance_us),
        ]


def parse_limits(value: object) -> dict[str, SharedLimit]:
    """``baton_limits`` as SharedLimits; ConfigError naming the bad entry."""
    if not isinstance(value, Mapping):
        raise ConfigError(
            f'expected a mapping of names to limits ({{"openai": "90000/m"}}), got {value!r}',
            subject="baton_limits",
        )
    table = {}
    for name, spec in value.items():
        subject = f"baton_limits[{name!r}]"
        if not isinstance(name, str) or not name or set(name) & set("{}"):
            raise ConfigError("a name is a non-empty string without braces", subject=subject)
        table[name] = parse_limit(name, spec, subject=subject)
    return table


def parse_limit(name: str, spec: object, *, subject: str) -> SharedLimit:
    if isinstance(spec, Mapping):
        for field in spec:
            if field not in LIMIT_FIELDS:
                hint = suggest(str(field), LIMIT_FIELDS)
                if field == "concurrency":
                    hint = (
                        " (named limits are rates; a concurrency cap shared by tasks is a "
                        "global_concurrency on one task, or one task that calls the others)"
                    )
                raise ConfigError(f"unknown field {field!r}{hint}", subject=subject)
        if "rate" not in spec:
            raise ConfigError('a limit needs a "rate"', subject=subject)
        per_second = parse_rate(spec["rate"], subject=subject)
        burst = (
            parse_burst(spec["burst"], subject=f"{subject}.burst")
            if "burst" in spec
            else default_burst(spec["rate"])
        )
        return SharedLimit(name, per_second, burst)
    per_second = parse_rate(spec, subject=subject)  # type: ignore[arg-type]
    return SharedLimit(name, per_second, default_burst(spec))


def default_burst(rate: object) -> int:
    """The count of the rate's period: ``"90000/m"`` -> 90000, ``2.5`` (per second) -> 2."""
    if isinstance(rate, str):
        match = _COUNT_RE.match(rate)
        count = float(match.group(1)) if match else 1.0
    else:
        count = float(rate)  # type: ignore[arg-type]
    return max(1, math.floor(count))


def resolve(
    table: Mapping[str, SharedLimit], names: object, *, subject: str
) -> tuple[SharedLimit, ...]:
    """A task's ``limits=`` (a name or a list of names) as SharedLimits; an unknown name
    is a ConfigError with a suggestion."""
    if isinstance(names, str):
        names = [names]
    if not isinstance(names, Sequence) or not names:
        raise ConfigError(f"expected a list of limit names, got {names!r}", subject=subject)
    found = []
    for name in names:
        if name not in table:
            known = ", ".join(sorted(table)) or "none declared"
            raise ConfigError(
                f"unknown limit {name!r}{suggest(str(name), table)}; baton_limits has: {known}",
                subject=subject,
            )
        found.append(table[name])
    if len(set(found)) != len(found):
        raise ConfigError(f"the same limit twice in {list(names)!r}", subject=subject)
    return tuple(found)


def call_cost(
    cost: Cost | None, limits: Sequence[SharedLimit], args: Sequence[Any], kwargs: Mapping[str, Any]
) -> float:
    """One call's cost (1 by default, or the callable's answer), checked against every
    limit; CostError when one could never admit it or the callable failed."""
    value: object = 1 if cost is None else cost
    if callable(value):
        try:
            value = value(*args, **kwargs)
        except Exception as exc:
            raise CostError(f"the cost callable failed: {exc!r}", subject="cost") from exc
    for limit in limits:
        value = limit.check_cost(value, subject=f"cost for limit {limit.name!r}")
    return float(value)  # type: ignore[arg-type]


class NamedLimit:
    """A named limit used in code, outside a task's admission::

        with baton.limit("openai", cost=tokens, timeout=30):
            call_openai()                       # blocks until the budget has room

        if baton.limit("openai").try_acquire(cost=tokens).granted: ...
        baton.limit("openai").penalize(retry_after)  # a 429: every worker backs off

    Nothing is given back on exit: a rate is spent when the work starts.
    """

    def __init__(
        self,
        gate: Gate,
        names: KeyNames,
        limit: SharedLimit,
        *,
        cost: float = 1,
        timeout: float | None = None,
    ) -> None:
        self.gate = gate
        self.names = names
        self.limit = limit
        self.cost = cost
        self.timeout = timeout

    def try_acquire(self, cost: float | None = None) -> Decision:
        """Spend ``cost`` now if the budget has room; else ``retry_after`` (seconds),
        nothing spent. CostError for a cost this limit can never admit."""
        return self.gate.decide(self._conditions(cost), owner="-")

    def acquire(self, cost: float | None = None, *, timeout: float | None = None) -> Decision:
        """Wait (sleeping, on the store's ``retry_after``) until ``cost`` is spent;
        LimitTimeout when that would take longer than ``timeout`` (None: no bound)."""
        timeout = self.timeout if timeout is None else timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        decision = self.gate.wait_for_grant(
            self._conditions(cost), owner="-", deadline=deadline, subject=self.limit.name
        )
        if decision.granted:
            return decision
        next_in = (
            "never while it stands" if decision.retry_after < 0 else f"{decision.retry_after:.3f}s"
        )
        raise LimitTimeout(
            f"limit {self.limit.name!r}: no room for cost "
            f"{self.cost if cost is None else cost:g} within {timeout:g}s (next in {next_in})",
            limit=self.limit.name,
            retry_after=decision.retry_after,
        )

    def _conditions(self, cost: float | None) -> list[Condition]:
        checked = self.limit.check_cost(
            self.cost if cost is None else cost, subject=f"limit {self.limit.name!r}"
        )
        return self.limit.conditions(self.names, checked)

    def penalize(self, seconds: float) -> float:
        """Hold every admission under this limit (tasks on every worker, and code) for
        ``seconds``; extends a longer penalty never shortens it. Returns how long the
        penalty lasts from now."""
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) or seconds < 0:
            raise ConfigError(f"a penalty is seconds >= 0, got {seconds!r}", subject="penalize")
        return self.gate.penalize(self.names.shared_penalty(self.limit.name), seconds)

    def __enter__(self) -> Decision:
        return self.acquire()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None
