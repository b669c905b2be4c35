"""What Celery sizes by the requests a worker reserved, counting the pool's work only.

A request celery-baton holds for a limit, or a batched call waiting for its batch, is
reserved (``worker.state.reserved_requests``: Celery's strategy reserved it before it
reached the gate) yet takes no pool process. Celery's own waiting requests are not
reserved while they wait (a ``rate_limit``'s bucket, an ETA's timer), and two of its
settings size the worker by that count:

* ``worker_disable_prefetch`` (Celery 5.6, Redis): the task channel's ``can_consume``
  takes a message only while fewer requests are reserved than the pool has processes.
  Counting held ones, two held requests kept a worker of two idle processes from taking
  anything else until they ran (10 plain tasks behind 40 held ones started 17-18 s
  late);
* ``--autoscale``: the autoscaler grows the pool to the number of reserved requests.
  Counting held ones, 40 held calls of a task two a second kept it at its maximum (a
  burst of limited calls grows it as any work does: a limit is judged when a process
  can start the call; once held, they no longer keep it grown).

Both are made here without the held requests (tests/worker/test_held_not_pool_work.py).

Held requests raise the prefetch count as ETA tasks do, so that they leave the window to
the work the worker can run; Celery's ``worker_eta_task_limit`` (5.5) caps that raise
(kombu's ``QoS.max_prefetch``) to bound the ETA tasks a worker keeps. Capped, held
requests took the window (10 plain tasks behind 40 held ones started 13.5 s late), and
every capped raise, lowered without the cap, shrank the window for good. Held requests
have their own bound (``baton_hold_max``): each raises the cap with the count
(``raise_window``, ``lower_window``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from celery.worker import state as worker_state

logger = logging.getLogger("celery_baton.worker")

_INSTALLED_ATTR = "_baton_pool_work_only"
_ETA_LIMIT_ATTR = "_baton_eta_task_limit"


def install_intake(consumer: Any, channel: Any, held: Callable[[], int]) -> bool:
    """Make the ``can_consume`` Celery narrowed on ``channel`` (the consumer's task
    channel) leave out the ``held()`` requests; False when Celery did not narrow it."""
    qos = getattr(channel, "qos", None)
    if qos is None or "can_consume" not in vars(qos):
        return False
    if not consumer.app.conf.get("worker_disable_prefetch"):
        return False  # narrowed by something else: not ours to change
    if getattr(qos, _INSTALLED_ATTR, False):
        return True
    window_check = type(qos).can_consume

    def can_consume() -> bool:
        # Celery's limit, read as Celery reads it (celery/worker/consumer/tasks.py); then
        # the channel's own prefetch window, as in Celery's.
        controller = getattr(consumer, "controller", None)
        limit = getattr(controller, "max_concurrency", None) or consumer.pool.num_processes
        if len(worker_state.reserved_requests) - held() >= limit:
            return False
        return bool(window_check(qos))

    qos.can_consume = can_consume
    setattr(qos, _INSTALLED_ATTR, True)
    return True


def install_autoscaler(autoscaler: Any, held: Callable[[], int]) -> bool:
    """Make ``autoscaler`` (``--autoscale``) size the pool without the ``held()``
    requests; False when there is none, or its ``qty`` is not Celery's property."""
    if autoscaler is None:
        return False
    base = type(autoscaler)
    if getattr(base, _INSTALLED_ATTR, False):
        autoscaler._baton_held = held  # a consumer restart: the same autoscaler
        return True
    counted = getattr(base, "qty", None)
    if not isinstance(counted, property) or counted.fget is None:
        logger.warning(
            "baton: the autoscaler %s has no qty property: it counts held requests as "
            "the pool's work",
            base.__qualname__,
        )
        return False
    reserved = counted.fget

    class PoolWorkOnly(base):  # type: ignore[misc,valid-type]
        @property
        def qty(self) -> int:
            return max(0, int(reserved(self)) - int(self._baton_held()))

    PoolWorkOnly.__name__ = PoolWorkOnly.__qualname__ = base.__name__
    setattr(PoolWorkOnly, _INSTALLED_ATTR, True)
    autoscaler._baton_held = held
    autoscaler.__class__ = PoolWorkOnly
    return True


def raise_window(qos: Any) -> None:
    """One more message in Celery's prefetch ``qos`` for a held request, past the cap of
    ``worker_eta_task_limit`` (which is the ETA tasks')."""
    cap = getattr(qos, "max_prefetch", None)
    if cap is not None:
        qos.__dict__.setdefault(_ETA_LIMIT_ATTR, cap)  # Celery's own, kept
        qos.max_prefetch = cap + 1
    qos.increment_eventually()


def lower_window(qos: Any) -> None:
    """The held request's message left: the count, and its cap, as before its raise."""
    qos.decrement_eventually()
    cap = getattr(qos, "max_prefetch", None)
    if cap is not None:
        # Never below Celery's own (a consumer restart makes a new qos, not raised).
        qos.max_prefetch = max(cap - 1, qos.__dict__.get(_ETA_LIMIT_ATTR, cap))
