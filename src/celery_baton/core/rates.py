"""Rate strings and the GCRA rate primitive. Celery-free.

GCRA (the generic cell rate algorithm) keeps one number per limit: the theoretical
arrival time (TAT) of the next request. A request may start when
``now >= TAT + interval - burst * interval``; starting moves TAT one interval ahead.
It is a token bucket with ``burst`` tokens that refills one token per interval, exact,
one key, one round trip, and it says how long to wait (``retry_after``).

It is strict: a late start earns no credit, so in every window of length ``w`` at most
``burst + w * rate`` runs start. The price is that any lateness of a waiting worker is
lost rate; the consumer therefore wakes throttled requests exactly at ``retry_after``
(no jitter). With ``burst >= 2`` lateness below one interval is absorbed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from celery_baton.core.conditions import Rate
from celery_baton.core.gate import Decision, Gate
from celery_baton.errors import RateSpecError

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_UNIT_NAMES = {
    **{name: "s" for name in ("s", "sec", "second")},
    **{name: "m" for name in ("m", "min", "minute")},
    **{name: "h" for name in ("h", "hour")},
    **{name: "d" for name in ("d", "day")},
}
_RATE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(?:/\s*([a-z]+))?\s*$")


def check_celery_rate(value: object, *, subject: str | None = None) -> None:
    """``value``, a task's own ``rate_limit``, must also be one Celery reads: Celery's
    worker parses it at start (``"N/s"``, ``"N/m"``, ``"N/h"`` or a number, no spaces
    around the slash) and fails on anything else with a KeyError naming no task. Raises
    RateSpecError naming the task now, at its declaration."""
    if not isinstance(value, str):
        return
    count, _, unit = value.partition("/")
    try:
        float(count)
    except ValueError:
        unit = "?"
    if unit not in ("", "s", "m", "h"):
        raise RateSpecError(
            f"rate_limit={value!r} is not a rate Celery reads ('N/s', 'N/m', 'N/h' or a "
            "number per second): Celery's worker would fail on it at start (celery-baton's "
            "own global_rate_limit= also takes /d and unit names)",
            subject=subject,
        )


#: The units a rate is shown in, the first that counts it in whole runs.
_SHOWN_UNITS = (("s", 1), ("m", 60), ("h", 3600), ("d", 86400))


def rate_text(per_second: float) -> str:
    """A rate as an operator writes it: the first unit in which it counts whole runs
    (``10/m``, not ``0.166667/s``; ``90000/m`` reads ``1500/s``), else runs a second.

    >>> rate_text(parse_rate("10/m")), rate_text(2.5), rate_text(1 / 7)
    ('10/m', '150/m', '0.142857/s')
    """
    for unit, seconds in _SHOWN_UNITS:
        count = per_second * seconds
        whole = round(count)
        if whole >= 1 and abs(count - whole) <= 1e-9 * count:
            return f"{whole}/{unit}"
    return f"{per_second:g}/s"


def parse_rate(value: str | float | int, *, subject: str | None = None) -> float:
    """Requests per second from ``"N/s"``, ``"N/m"``, ``"N/h"``, ``"N/d"`` or a number.

    >>> parse_rate("10/m")
    0.16666666666666666
    """
    if isinstance(value, bool):
        raise RateSpecError(f"not a rate: {value!r}", subject=subject)
    if isinstance(value, int | float):
        per_second = float(value)
    elif isinstance(value, str):
        match = _RATE_RE.match(value)
        if not match:
            raise RateSpecError(
                # 'N/d' too: the unit error below offers d, this one used to leave it out.
                f"not a rate: {value!r}; write 'N/s', 'N/m', 'N/h', 'N/d' (lower case) or a "
                "number per second",
                subject=subject,
            )
        count, unit = match.groups()
        unit = _UNIT_NAMES.get(unit or "s")
        if unit is None:
            raise RateSpecError(
                f"unknown unit in {value!r}; use s, m, h or d (or sec, second, min, minute, "
                "hour, day)",
                subject=subject,
            )
        per_second = float(count) / _UNITS[unit]
    else:
        raise RateSpecError(f"not a rate: {value!r}", subject=subject)
    if not per_second > 0 or per_second == float("inf"):
        raise RateSpecError(f"a rate must be positive and finite, got {value!r}", subject=subject)
    return per_second


def parse_burst(value: object, *, subject: str | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RateSpecError(f"burst must be an int >= 1, got {value!r}", subject=subject)
    return value


def interval_us(per_second: float) -> int:
    """The GCRA emission interval in microseconds (at least 1)."""
    return max(1, round(1_000_000 / per_second))


@dataclass
class RateLimit:
    """A rate shared by every process that uses the same store key.

    >>> limit = RateLimit(gate, "baton:{api}:rate:x", rate="10/s", burst=2)  # doctest: +SKIP
    >>> limit.try_acquire().granted  # doctest: +SKIP
    True
    """

    gate: Gate
    key: str
    rate: str | float = 1.0
    burst: int = 1

    def __post_init__(self) -> None:
        self._condition = Rate(
            self.key,
            interval_us(parse_rate(self.rate, subject=self.key)),
            parse_burst(self.burst, subject=self.key),
        )

    def try_acquire(self) -> Decision:
        """Take one start now, or learn ``retry_after`` (seconds) without taking anything."""
        return self.gate.decide([self._condition], owner="-")
