"""A throttle's window judged where its run starts (issue 34 (d)).

The main process admits a throttled delivery when the store opens its key's window
(throttle_decide.lua: at most one start per window), and hands it to the pool at once.
What happens after the hand-over it cannot see: the pool process may start the body
late (stopped, swapped out, or the main process stopped between the hand-over and the
pool's write to the child's pipe; on threads and gevent, a thread or the hub busy). The
window then counted from a moment before the start, and the next window's run, on
another worker, started less than a window after it.

So the request carries the moment its window was asked for and the call that moves
it, and the process that starts the body looks at the clock first (``judge``). Later
than ``STALE_GRANT`` (a hand-over takes milliseconds), the store is told the run starts
now (throttle_started.lua): its window is moved to count from now (never shortened),
or, if it ran out and another run opened the next one meanwhile, the run waits for
that window to end and opens the one after it. Every two starts of a key are then a
window apart, on the store's clock. A run whose window another run took is not dropped
(``throttle_mode="drop"``): it was admitted, and runs in a later window. A store that
does not answer is asked again every ``_STORE_RETRY`` s, as for a rate's fresh token:
the run waits, holding its process.

Where the judgement is made: a prefork process judges as it takes the job from its
pipe, before it accepts it (``worker/pool/prefork.py``): no time limit runs and nothing
is acknowledged while it waits. Threads and gevent judge on the thread or greenlet that
runs the body (``worker/pool/in_process.py``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import Any

from celery_baton.core.debounce import FlowKind, FlowPolicy, throttle_started
from celery_baton.errors import StoreUnavailable
from celery_baton.worker.pool.rate_grant import STALE_GRANT

logger = logging.getLogger("celery_baton.worker")

THROTTLE_FIELD = "baton_throttle"

#: While the store does not answer, how long to wait before asking again (s).
_STORE_RETRY = 0.5


def mark(
    request_dict: dict[str, Any],
    flow: FlowPolicy | None,
    flow_key: str | None,
    task_id: str,
    asked_at: float,
) -> None:
    """Main process, as a throttled request goes to the pool: when its window was asked
    for (``time.monotonic()``) and the call that moves it. Nothing for other tasks."""
    if flow is None or flow.kind is not FlowKind.THROTTLE or flow_key is None or not asked_at:
        return
    _script, keys, args = flow.started_call(flow_key, task_id)
    request_dict[THROTTLE_FIELD] = (os.getpid(), asked_at, keys, args)


def judge(store: Any, name: str, task_id: str, request_dict: Mapping[str, Any]) -> None:
    """Just before the body of ``task_id`` starts: if its throttle window was opened too
    long ago, it is moved to now (or the run waits for another run's window)."""
    fields = request_dict.get(THROTTLE_FIELD)
    if not fields:
        return
    _main_pid, asked_at, keys, args = fields
    late = time.monotonic() - asked_at
    if late <= STALE_GRANT:
        return
    logger.info(
        "%s[%s] starts %.2fs after its throttle window opened: the window counts from its start",
        name,
        task_id,
        late,
    )
    while True:
        try:
            wait = throttle_started(store, keys, args)
        except StoreUnavailable as exc:
            logger.warning(
                "baton: %s[%s]'s throttle window waits for the store: %s", name, task_id, exc
            )
            time.sleep(_STORE_RETRY)
            continue
        if not wait:
            return
        logger.info(
            "%s[%s]: another run took its key's throttle window meanwhile; starting when it "
            "ends, in %.2fs",
            name,
            task_id,
            wait,
        )
        time.sleep(wait)
