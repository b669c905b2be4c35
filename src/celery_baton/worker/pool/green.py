"""gevent and eventlet: the worker's broker reconnect must let the greenlets run.

Celery patches the ``time`` module for a green pool after kombu was imported, and
kombu's ``retry_over_time`` (the consumer's reconnect to the broker) waits with the
``sleep`` it bound at its import: the real one. While the broker stays away, every
greenlet of the worker then stands still between two connection attempts (2, 4, 6 ...
up to 30 s): the task bodies, and celery-baton's lease renewer. A run's lease ran out
in the store while its body stood still, another worker took the key, and the body went
on beside that run once the reconnect let it: two runs of one exclusive key. And a
body that ended could not record its end (``worker/pool/run_end.py``) until the next
attempt.

So on a green pool those modules wait with the patched ``time.sleep``, which yields to
the other greenlets (``install``). The names are checked by
``internals.reconnect_sleepers``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from celery_baton import internals

logger = logging.getLogger("celery_baton.worker")


def install(task_pool: Any) -> None:
    """On a green pool, the reconnect's waits yield to the other greenlets."""
    if not getattr(task_pool, "is_green", False):
        return
    for module in internals.reconnect_sleepers():
        if module.sleep is not time.sleep:
            module.sleep = time.sleep
            logger.debug("baton: %s waits cooperatively (green pool)", module.__name__)
