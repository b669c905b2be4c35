"""A rate grant judged again in the pool process, as it takes the job (before accepting it).

The main process hands a granted request to the pool at the grant's moment, only to a
process that can start it now (``worker/pool_slots.py``), and checks that it is not
late (``worker/starting.py``, ``STALE_GRANT``). What happens after the hand-over it
cannot see: the pool process it was written to may stand still before it reads the job
(stopped, swapped out, or the main process itself stopped between the hand-over and the
pool's write to the child's pipe). The body then starts late, and together with the
grants that follow: two starts at once of a limit of one a second.

So the request carries its grant's moment and its rate conditions, and the pool process
looks at the clock when it takes the job from its pipe (``judge``, called through
``worker/pool/at_start.py`` by ``worker/pool/prefork.py``). Later than
``STALE_GRANT``: the grant's token is left spent (the error is on the limit's side)
and a fresh one is taken, waiting for it as the gate says; the process is busy
meanwhile, which only such a late start pays.

It is judged there, before the process accepts the job, not in ``task_prerun``: Celery
starts a job's time limits, and acknowledges its message (``acks_late=False``), when the
process accepts it. A wait in ``task_prerun`` was cut by a soft limit (Celery's signal
dispatch swallows ``SoftTimeLimitExceeded``, and the body started without a token) or
ended by a hard one (the process killed, the message consumed, the body never run).
Before the accept, no limit runs and the message is the broker's; a process that dies
while it waits leaves the job unaccepted, and Celery writes it to another process.

Without a pool process the body starts in the main process: a gevent greenlet judges
it before the body (``worker/pool/in_process.py``, where threads and solo are said).

``time.monotonic()`` is one clock for every process of a machine (Linux's
``CLOCK_MONOTONIC``), so the main process's moment can be read in its pool process.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import Any

from celery import current_app

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


def judge(name: str, task_id: str, request_dict: Any) -> None:
    """Just before the body of ``task_id`` starts (``worker/pool/at_start.py``): if it
    carries a rate grant handed over too long ago, a fresh token is taken first."""
    fields = request_dict.get(RATE_GRANT_FIELD) if isinstance(request_dict, dict) else None
    if not fields:
        return
    try:
        _main_pid, due, owner, rates = fields
        late = time.monotonic() - due
        if late <= STALE_GRANT:
            logger.debug(
                "%s[%s] reached its pool process %.3fs after its grant", name, task_id, late
            )
            return
        logger.info(
            "%s[%s] reached its pool process %.2fs after its rate grant: taking a fresh "
            "one before it is accepted",
            name,
            task_id,
            late,
        )
        app = current_app.tasks[name].app
        wait_for_grant(parts_for(app).gate, conditions_of(rates), owner)
        logger.debug("%s[%s] took its fresh rate grant", name, task_id)
    except Exception:  # never lose the job: it runs on its grant, and the error is logged
        logger.exception("baton: %s[%s]: taking a fresh rate grant failed", name, task_id)


def wait_for_grant(gate: Gate, conditions: Sequence[Condition], owner: str) -> None:
    """Ask ``gate`` for ``conditions`` until it grants them (``Gate.wait_for_grant``):
    the token is taken before the body, so a store that does not answer is waited for."""
    gate.wait_for_grant(
        conditions, owner=owner, reserve=1.0, store_retry=_STORE_RETRY, subject="a fresh rate grant"
    )
