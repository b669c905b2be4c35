"""Celery's prefork pool, told what celery-baton needs of it (issue 34 §1-2).

Two assumptions of the worker did not hold of Celery's prefork pool, and are made to
hold here, on the pool the worker is about to start (``install``):

**A free semaphore is not a process that can start a job now.** Celery releases its
pool semaphore when a process reports a job READY, although a process that ran its
``--max-tasks-per-child`` is leaving, and again when the pool joins that process; its
replacement was forked at the pool's next maintenance tick (every 5 s), because the
exit event Celery watches fires when the process closes its pipes, before it can be
reaped, and is not watched again. A request granted on such a slot held its leases, its
rate token or its throttle window for seconds while no process could start it.
``ReadyAsynPool`` says how many processes can start a job now (``startable``: up,
idle, not leaving, less the jobs already waiting to be written to one), calls
``on_change`` when that may have grown (a job READY, a process up, one joined), and
joins a leaving process and forks its replacement as soon as it can be reaped.

**The time limits do not start with the task body.** Celery starts a job's time limits,
and acknowledges its message (``acks_late=False``), when the pool process accepts the
job, before ``task_prerun``. A fresh rate token waited for there was cut by a soft
limit (the body then started without one) or killed by a hard one (the message was
consumed, the body never ran). So the pool process judges a rate grant, and a
throttle's window, as it takes the job from its pipe, before it accepts it
(``AcceptingWorker``; the judgements are in ``worker/pool/at_start.py``): no limit
runs and nothing is acknowledged while it waits, and if the process dies meanwhile
Celery gives the job, never accepted, to another process.

The private names used here are checked by ``internals.prefork_pool_classes``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from billiard import pool as billiard_pool
from celery.concurrency import asynpool

from celery_baton.worker.pool import at_start

logger = logging.getLogger("celery_baton.worker")

#: How often a leaving process is looked at until it can be reaped (s), and for how
#: long at most (then Celery's own 5 s tick joins it).
REAP_POLL = 0.05
REAP_FOR = 5.0

#: Celery's scheduling that writes a job to any process, also a busy one
#: (``optimization="fast"`` given to the worker in code; its command line offers "fair").
FIRST_COME = ("fast", "fcfs")

#: A process's count of jobs reported READY (set on Celery's process object).
_DONE_ATTR = "_baton_done"


def _judging(receive: Callable[[], Any]) -> Callable[[], Any]:
    """The pool process's ``wait_for_job``, judging each job before it is accepted."""

    def wait_for_job() -> Any:
        job = receive()
        if job:
            job = at_start.judge_before_accept(job)
        return job

    return wait_for_job


class AcceptingWorker(asynpool.Worker):  # type: ignore[misc]
    """Celery's pool process (event loop): judges a rate grant before accepting it."""

    def _make_child_methods(self, *args: Any, **kwargs: Any) -> None:
        super()._make_child_methods(*args, **kwargs)
        self.wait_for_job: Callable[[], Any] = _judging(self.wait_for_job)


class AcceptingBlockingWorker(billiard_pool.Worker):  # type: ignore[misc]
    """billiard's pool process (prefork without the event loop): the same."""

    def _make_child_methods(self, *args: Any, **kwargs: Any) -> None:
        super()._make_child_methods(*args, **kwargs)
        self.wait_for_job: Callable[[], Any] = _judging(self.wait_for_job)


class ReadyAsynPool(asynpool.AsynPool):  # type: ignore[misc]
    """Celery's event-loop prefork pool that knows which processes can start a job now."""

    Worker = AcceptingWorker

    #: Called on the consumer's loop when more processes may be able to start a job.
    on_change: Callable[[], None] | None = None

    def startable(self) -> int:
        """How many jobs a process could start now: processes up (they said WORKER_UP),
        alive, idle and not leaving, less the jobs waiting to be written to one."""
        maxtasks = self._maxtasksperchild
        free = 0
        for proc in list(self._pool):
            fd = proc.inqW_fd
            if fd not in self._all_inqueues or fd in self._busy_workers:
                continue
            if maxtasks and getattr(proc, _DONE_ATTR, 0) >= maxtasks:
                continue  # leaving: it ran its --max-tasks-per-child
            if getattr(proc, "dead", False) or not proc._is_alive():
                continue
            free += 1
        return free - len(self.outbound_buffer)

    def _changed(self) -> None:
        if self.on_change is not None:
            try:
                self.on_change()
            except Exception:  # a pool callback must not break Celery's result handler
                logger.exception("baton: serving requests that wait for a pool process failed")

    def on_job_ready(self, job: Any, i: Any, obj: Any, inqW_fd: Any) -> None:
        # Counted before Celery releases its semaphore (right after this returns), so
        # that a request given the slot sees the process leaving.
        proc = self._fileno_to_inq.get(inqW_fd)
        if proc is not None:
            done = getattr(proc, _DONE_ATTR, 0) + 1
            setattr(proc, _DONE_ATTR, done)
            if self._maxtasksperchild and done >= self._maxtasksperchild:
                self._replace_when_gone(proc)
        super().on_job_ready(job, i, obj, inqW_fd)
        self._changed()

    def on_process_alive(self, pid: int) -> None:
        super().on_process_alive(pid)
        self._changed()

    def _event_process_exit(self, hub: Any, proc: Any) -> None:
        super()._event_process_exit(hub, proc)
        if proc.exitcode is None:  # it closed its pipes, and is not reaped yet
            self._replace_when_gone(proc)
        self._changed()

    def _replace_when_gone(self, proc: Any, waited: float = 0.0) -> None:
        """Join ``proc`` and fork its replacement as soon as it can be reaped."""
        hub = getattr(self, "_baton_hub", None)
        if hub is None or waited > REAP_FOR or proc not in self._pool:
            return
        if proc.exitcode is None:
            hub.call_later(REAP_POLL, self._replace_when_gone, proc, waited + REAP_POLL)
            return
        self.maintain_pool()
        self._changed()

    def register_with_event_loop(self, hub: Any) -> None:
        self._baton_hub = hub
        super().register_with_event_loop(hub)


class JudgingBlockingPool(billiard_pool.Pool):  # type: ignore[misc]
    """billiard's prefork pool (Celery without the event loop) with judging processes."""

    Worker = AcceptingBlockingWorker


def install(task_pool: Any) -> str | None:
    """Make Celery's prefork ``task_pool`` start the pools above; None when done, else
    why it cannot (the worker is then refused: its limits would not hold)."""
    from celery_baton import internals

    classes = internals.prefork_pool_classes(task_pool)
    if classes is None:
        return (
            f"the worker's pool {type(task_pool).__module__}.{type(task_pool).__name__} "
            "is not Celery's prefork pool as celery-baton knows it (its Pool and "
            "BlockingPool must be Celery's own)"
        )
    strategy = (getattr(task_pool, "options", None) or {}).get("sched_strategy")
    if strategy in FIRST_COME:
        return (
            f"the prefork pool writes jobs to busy processes (optimization {strategy!r}): a "
            'granted request would wait behind another job; use "fair", Celery\'s default'
        )
    if getattr(task_pool, "_pool", None) is not None:
        return "the prefork pool started before celery-baton's consumer step was created"
    task_pool.Pool = ReadyAsynPool
    task_pool.BlockingPool = JudgingBlockingPool
    return None
