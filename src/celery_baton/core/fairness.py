"""Fairness across keys of one shared limit (``fair_key``). Celery-free, pure logic.

A shared cap (``global_concurrency=4``) or rate (``global_rate_limit="100/s"``) is
first come, first served: a tenant that queued 10,000 requests starves one that
queued 10. With ``fair_key="tenant"`` the gate keeps, per shared limit, the set of
tenants that have requests waiting, each with a *pass* (stride scheduling): while the
limit is saturated, a free slot goes only to a waiting tenant among the first
``free`` by pass, and every grant moves that tenant's pass on by ``STRIDE / weight``.
With equal weights that is round-robin: a tenant runs again only after every other
waiting tenant ran once; a tenant of weight 3 runs three times per round.

What the store keeps (gate.lua, kind "F"), all in the task's ``{hash tag}``:

* ``<fair>``    hash: ``n:<key>`` how many workers hold requests of ``<key>``, ``vt``
  the pass of the latest grant (a tenant that starts waiting starts there);
* ``<fair>:q``  sorted set: the waiting keys by pass;
* ``<fair>:p``  sorted set: ``<key>|<worker>`` by the moment that presence expires:
  a worker renews it with every ask, and a key no worker renews leaves the queue;
* ``<fair>:s``  sorted set: the pass of keys that left the queue and ran ahead of
  ``vt``, so that coming back at once gives no head start.

Each worker knows which keys it holds (its own held requests); the store learns it
from their asks, so workers that each hold part of the messages share one order.
Everything expires ``2 * PRESENCE`` after the last ask: keys with nothing waiting
cost nothing.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from celery_baton.core.conditions import Condition, FairPart, FairTurn
from celery_baton.core.keys import KeySpec, digest
from celery_baton.errors import ConfigError

logger = logging.getLogger("celery_baton.core.fairness")

#: A weight-1 key's pass moves this much per grant (a weight-w key's: STRIDE / w).
STRIDE = 1_000_000
MAX_WEIGHT = 1000.0
#: Seconds a worker's "I hold requests of this key" lasts unless renewed; held
#: requests ask again at least every PRESENCE / 3 (see ``REFRESH``).
PRESENCE = 6.0
REFRESH = PRESENCE / 3

Weights = Mapping[Any, float] | Callable[[Any], float]


def check_weight(value: Any, subject: str) -> float:
    """A weight: a number in (0, MAX_WEIGHT]; raises ConfigError otherwise."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not 0 < value <= MAX_WEIGHT
    ):
        raise ConfigError(
            f"a weight must be a number > 0 and <= {MAX_WEIGHT:g}, got {value!r}",
            subject=subject,
        )
    return float(value)


def check_weights(value: Any, subject: str) -> Weights | None:
    """``fair_weights``: a mapping of key value to weight, or a callable of the key
    value returning one; checked now (a mapping's every weight), not at the first run."""
    if value is None:
        return None
    if callable(value):
        return value  # type: ignore[no-any-return]
    if not isinstance(value, Mapping):
        raise ConfigError(
            "expected a mapping {key value: weight} or a callable (key value) -> weight, "
            f"got {type(value).__name__}",
            subject=subject,
        )
    for key, weight in value.items():
        check_weight(weight, f"{subject}[{key!r}]")
    return value


@dataclass(frozen=True)
class FairPolicy:
    """``fair_key`` and ``fair_weights`` of a task, compiled."""

    key: KeySpec
    weights: Weights | None = None

    def value(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[Any, str]:
        """The fair key's value (what weights are looked up by: the argument itself for
        one argument name, else the key's text) and its digest."""
        material = self.key.material(args, kwargs)
        if len(self.key.names) == 1 and self.key.template is None:
            return self.key.arguments(args, kwargs)[self.key.names[0]], digest(material)
        return material, digest(material)

    def stride(self, value: Any) -> int:
        """How far one grant moves this value's pass: ``STRIDE / weight``. A callable
        that fails or returns a bad weight counts as weight 1, logged: the run is not
        lost over its weight."""
        if self.weights is None:
            return STRIDE
        try:
            if callable(self.weights):
                weight = check_weight(self.weights(value), self.key.subject)
            else:
                weight = float(self.weights.get(value, 1.0))
        except Exception as exc:
            logger.warning("%s: weight of %r: %s; using 1", self.key.subject, value, exc)
            weight = 1.0
        return max(1, round(STRIDE / weight))


def conditions(base: str, fair_digest: str, stride: int) -> list[Condition]:
    """The FairTurn over ``base`` and its three parts (keys only), to follow the
    limit's own condition in a plan."""
    return [
        FairTurn(base, fair_digest, stride, round(PRESENCE * 1000)),
        FairPart(f"{base}:q"),
        FairPart(f"{base}:p"),
        FairPart(f"{base}:s"),
    ]


def with_more(conditions: Sequence[Condition], more: Callable[[str], bool]) -> list[Condition]:
    """``conditions`` for one ask: each FairTurn says whether this worker still holds other
    requests of its key after this one (``more(its key)``), so the store keeps the key
    waiting, or lets it leave when this was the last one here."""
    out = []
    for c in conditions:
        if isinstance(c, FairTurn):
            c = replace(c, more=more(c.key))
        out.append(c)
    return out


def leave_calls(
    conditions: Sequence[Condition], owner: str, more: Callable[[str], bool]
) -> list[tuple[list[str], list[str]]]:
    """The ``fair_leave`` calls (keys, args) for a request that leaves this worker
    without a run after it waited its turn: one per FairTurn whose key no other request
    here still waits for (``more(its key)`` false). Its presence would otherwise keep
    the key in the turn, ahead of the others, until it lapsed (``PRESENCE``)."""
    calls = []
    for i, c in enumerate(conditions):
        if isinstance(c, FairTurn) and not more(c.key):
            parts = [p.key for p in conditions[i + 1 : i + 4] if isinstance(p, FairPart)]
            calls.append(([c.key, *parts], [c.fair_key, owner]))
    return calls
