"""A rate grant judged again where the task body starts: in the pool process.

The main process hands a granted request to the pool at the grant's moment and checks
that it is not late (``worker/starting.py``, ``STALE_GRANT``). What happens after the
hand-over it cannot see: the pool process it was written to may stand still before it
reads the job (stopped, swapped out, or the main process itself stopped between the
hand-over and the pool's write to the child's pipe). The body then starts late, and
together with the grants that follow: two starts at once of a limit of one a second.

So the request carries its grant's moment and its rate conditions, and the pool process
looks at the clock before the body runs (``task_prerun``). Later than ``STALE_GRANT``:
the grant's token is left spent (the error is on the limit's side) and a fresh one is
taken here, waiting for it as the gate says; the pool process is busy meanwhile, which
only such a late start pays. Without a pool process (solo, threads) the body starts in
the main process, which judged it already: nothing is done here.

``time.monotonic()`` is one clock for every process of a machine (Linux's
``CLOCK_MONOTONIC``), so the main process's moment can be read in its pool process.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import Any

from celery import signals

from celery_baton.core.conditions import Condition, Override, Penalty, Rate, WeightedRate
from celery_baton.core.gate import Gate
from celery_baton.parts import parts_for

logger = logging.getLogger("celery_baton.worker")

RATE_GRANT_FIELD = "baton_rate_grant"

#: The conditions that make up a rate (an override edits the next one's limit; a
#: penalty holds a named limit): what a fresh token is asked for.
_RATE_KINDS: dict[str, type[Rate | WeightedRate | Penalty | Override]] = {
    kind.__name__: kind for kind in (Rate, WeightedRate, Penalty, Override)
}
#: The kinds that spend a token.
_TOKENS = ("Rate", "WeightedRate")

#: How late (s) a rate grant may be started after the store gave it (or after its
#: reserved instant). The hand-over to a pool process takes milliseconds; the rest of
#: the quarter second a start may come early by (docs/guides/rate-limits.md) is kept
#: for it. Judged by the main process before the hand-over, and here after it.
STALE_GRANT = 0.15

#: While the store does not answer, how long to wait before asking again (s).
_STORE_RETRY = 0.5


def mark(
    request_dict: dict[str, Any], conditions: Sequence[Condition], owner: str, due: float
) -> None:
    """Main process, as the request goes to the pool: the moment its rate grant is for
    (``time.monotonic()``) and what a fresh one would ask. Nothing if it holds no rate."""
    rates = [
        (kind, tuple(getattr(c, name) for name in c.__slots__))
        for c in conditions
        if (kind := type(c).__name__) in _RATE_KINDS
    ]
    if any(kind in _TOKENS for kind, _ in rates):
        request_dict[RATE_GRANT_FIELD] = (os.getpid(), due, owner, rates)


def conditions_of(rates: Sequence[tuple[str, Sequence[Any]]]) -> list[Condition]:
    """The conditions ``mark`` wrote (as plain tuples: they cross a pipe)."""
    return [_RATE_KINDS[kind](*fields) for kind, fields in rates]


def take_fresh_grant(sender: Any = None, task: Any = None, **_: Any) -> None:
    """``task_prerun``: in the pool process, a grant handed over too long ago is
    replaced by a fresh one before the body runs."""
    if task is None:
        return
    fields = getattr(task.request, RATE_GRANT_FIELD, None)
    if not fields:
        return
    main_pid, due, owner, rates = fields
    late = time.monotonic() - due
    if main_pid == os.getpid() or late <= STALE_GRANT:
        return
    logger.info(
        "%s[%s] reached its pool process %.2fs after its rate grant: taking a fresh one "
        "before it starts",
        task.name,
        task.request.id,
        late,
    )
    wait_for_grant(parts_for(task.app).gate, conditions_of(rates), owner)


def wait_for_grant(gate: Gate, conditions: Sequence[Condition], owner: str) -> None:
    """Ask ``gate`` for ``conditions`` until it grants them (``Gate.wait_for_grant``):
    the token is taken before the body, so a store that does not answer is waited for."""
    gate.wait_for_grant(
        conditions, owner=owner, reserve=1.0, store_retry=_STORE_RETRY, subject="a fresh rate grant"
    )


def install() -> None:
    signals.task_prerun.connect(take_fresh_grant, weak=False, dispatch_uid="baton-rate-grant")
