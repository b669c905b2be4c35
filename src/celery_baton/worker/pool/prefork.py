"""Celery's prefork pool, told what celery-baton needs of it (issue 34 §1-2).

Two assumptions of the worker did not hold of Celery's prefork pool, and are made to
hold here, on the pool the worker is about to start (``install``):

**A free semaphore is not a process that can start a job now.** Celery releases its
pool semaphore when a process reports a job READY, although a process that ran its
``--max-tasks-per-child`` is leaving, and again when the pool joins that process; its
replacement was forked at the pool's next maintenance tick (every 5 s), because the
exit event Celery watches fires when the process closes its pipes, before it can be
reaped, and is not watched again. A request granted on such a slot held its leases, its
rate token or its throttle window for seconds while no process could start it. A
process past its ``--max-memory-per-child`` leaves the same way, unannounced: its peak
memory is read when it reports a job READY, as it reads it itself.
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

**A job the main process let go of is not run.** At a warm shutdown, and when the broker
connection is lost, Celery's ``AsynPool.flush`` drops every job its processes have not
accepted yet from its books: "they will be redelivered by the broker", and their ack
(``acks_late=False``) is never sent. A process that reads such a job and accepts it
anyway runs a body whose message comes back: the call runs twice. Celery's own window
for that is the microseconds between the write and the accept; a judgement before the
accept (a fresh rate token waited for) made it seconds. So the pool counts its flushes
in memory its processes share (``LetGo``), each job is stamped with the count as it
enters the pool (``ReadyAsynPool.apply_async``), and a process that finds the count
moved on when it is about to accept a job leaves it to the broker (``_judging``).

The private names used here are checked by ``internals.prefork_pool_classes``.
"""

from __future__ import annotations

import inspect
import logging
import mmap
import struct
import time
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

#: At most this many messages read from one process's result pipe at a flush (a
#: process sends two per job: ACK, READY).
READ_AT_FLUSH_MAX = 16

#: Celery's scheduling that writes a job to any process, also a busy one
#: (``optimization="fast"`` given to the worker in code; its command line offers "fair").
FIRST_COME = ("fast", "fcfs")

#: A process's count of jobs reported READY (set on Celery's process object).
_DONE_ATTR = "_baton_done"

#: Set on a process seen leaving after its ``--max-memory-per-child`` (the monotonic
#: time it was seen). A prediction, so it lapses: a process still here after
#: ``LEAVING_FOR`` s is counted again (Celery then writes to it as it always did).
_LEAVING_ATTR = "_baton_leaving_since"
LEAVING_FOR = 60.0


def peak_rss_kb(pid: int) -> int | None:
    """The peak resident set size of process ``pid`` in kB (``VmHWM``), the measure a
    billiard pool process compares with its ``--max-memory-per-child`` on Linux
    (``getrusage(RUSAGE_SELF).ru_maxrss``); None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/status", "rb") as status:
            for line in status:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


#: The pool's flush count when a job entered the pool (in the job's request dict).
LET_GO_FIELD = "baton_let_go"


class LetGo:
    """How many times the main process let go of the jobs its pool processes had not
    accepted (``AsynPool.flush``): a counter in anonymous shared memory, made by the
    main process before it forks, so every pool process reads the main process's
    count."""

    _FORMAT = "Q"

    def __init__(self) -> None:
        self._memory = mmap.mmap(-1, struct.calcsize(self._FORMAT))

    @property
    def count(self) -> int:
        return int(struct.unpack_from(self._FORMAT, self._memory)[0])

    def bump(self) -> None:
        """Main process only (the one writer)."""
        struct.pack_into(self._FORMAT, self._memory, 0, self.count + 1)


#: Made in the main process when the pool is installed; inherited by every pool process.
_let_go: LetGo | None = None


def _let_go_of(job: Any) -> bool:
    """Whether ``job`` (billiard's ``(TASK, (job, i, fun, args, kwargs))``) entered the
    pool before a flush of the main process: Celery dropped it, its message comes back."""
    if _let_go is None:
        return False
    try:
        args = job[1][3]
    except (TypeError, IndexError):
        return False
    found = at_start.task_request(args)
    if found is None or LET_GO_FIELD not in found[2]:
        return False
    name, task_id, request_dict = found
    if request_dict[LET_GO_FIELD] == _let_go.count:
        return False
    logger.info(
        "%s[%s] was let go by the worker (a shutdown or a lost broker connection) before "
        "its pool process accepted it: it does not start here, its message goes back to "
        "the broker",
        name,
        task_id,
    )
    return True


def _judging(receive: Callable[[], Any]) -> Callable[[], Any]:
    """The pool process's ``wait_for_job``, judging each job before it is accepted; a
    job the main process let go of meanwhile is not accepted (billiard's loop takes
    None as no job)."""

    def wait_for_job() -> Any:
        job = receive()
        if job:
            job = at_start.judge_before_accept(job)
            if _let_go_of(job):  # last, right before billiard sends the accept
                return None
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

    def _can_start(self, proc: Any) -> bool:
        """Whether ``proc`` could start a job now: up (it said WORKER_UP), idle, alive
        and not leaving."""
        fd = proc.inqW_fd
        if fd not in self._all_inqueues or fd in self._busy_workers:
            return False
        maxtasks = self._maxtasksperchild
        if maxtasks and getattr(proc, _DONE_ATTR, 0) >= maxtasks:
            return False  # leaving: it ran its --max-tasks-per-child
        leaving_since = getattr(proc, _LEAVING_ATTR, None)
        if leaving_since is not None and time.monotonic() - leaving_since < LEAVING_FOR:
            return False  # leaving: it passed its --max-memory-per-child
        return not getattr(proc, "dead", False) and bool(proc._is_alive())

    def startable(self) -> int:
        """How many jobs a process could start now, less the jobs waiting to be written
        to one."""
        free = sum(1 for proc in list(self._pool) if self._can_start(proc))
        return free - len(self.outbound_buffer)

    def describe(self) -> str:
        """What the pool says of its processes, for a log line: why none can start a job."""
        procs = []
        for proc in list(self._pool):
            fd = proc.inqW_fd
            flags = [
                "up" if fd in self._all_inqueues else "not-up",
                "busy" if fd in self._busy_workers else "idle",
                "alive" if proc._is_alive() else "gone",
            ]
            if getattr(proc, "dead", False):
                flags.append("dead")
            procs.append(f"{proc.pid}({','.join(flags)},done={getattr(proc, _DONE_ATTR, 0)})")
        return (
            f"processes [{' '.join(procs)}], {len(self._cache)} job(s) in the pool, "
            f"{len(self.outbound_buffer)} waiting to be written, state {self._state}"
        )

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
            elif self._leaving_for_memory(proc):
                setattr(proc, _LEAVING_ATTR, time.monotonic())
                self._replace_when_gone(proc)
        super().on_job_ready(job, i, obj, inqW_fd)
        self._changed()

    def _leaving_for_memory(self, proc: Any) -> bool:
        """Whether ``proc``, which just reported a job READY, leaves now for its
        ``--max-memory-per-child``: billiard's process compares its peak memory with the
        limit right after that report, and exits, unannounced, when it is above (a job
        written to it meanwhile waited for its exit, put back then: seconds with a slow
        ``worker_process_shutdown``). Read here just after the process read it, while it
        waits for its next job or exits: the same peak, as a rule. A process that reads a
        higher peak than this leaves all the same (its job is put back, as without this
        guess); one that stays although this says it leaves is counted again after
        ``LEAVING_FOR`` s."""
        limit = getattr(self, "_max_memory_per_child", None) or 0
        if limit <= 0:
            return False
        peak = peak_rss_kb(proc.pid)
        return peak is not None and peak > limit

    def on_process_alive(self, pid: int) -> None:
        super().on_process_alive(pid)
        self._changed()

    def _event_process_exit(self, hub: Any, proc: Any) -> None:
        super()._event_process_exit(hub, proc)
        # Still in the pool: it closed its pipes before it could be reaped. (Not
        # ``proc.exitcode is None``: reading it reaps a process that has just become
        # reapable, which would then wait for Celery's 5 s tick to be joined.)
        if proc in self._pool:
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

    def _worker_active(self, worker: Any) -> bool:
        """Whether ``worker`` has a job: billiard's ``shrink`` (``--autoscale``, from
        the autoscaler's thread) terminates the processes that have none, and counts a
        job only once its process accepted it. A process a job was written to (or is
        being written to) and that has not accepted it yet is busy too: terminated
        then, the job was lost with it (its lease kept its key held for good: a burst
        of exclusive calls never ran, tests/pools/test_autoscale.py, 4 of 10 runs once
        jobs were written at once, ``_write_now``)."""
        if super()._worker_active(worker):
            return True
        return any(
            not job._accepted and worker in (job._write_to, job._scheduled_for)
            for job in list(self._cache.values())
        )

    def apply_async(self, func: Any, args: Any = (), *rest: Any, **options: Any) -> Any:
        # Every job is stamped with the flush count it entered the pool under: a guarded
        # one may wait before its accept (a rate grant judged), and any job may wait in
        # its process's pipe behind the job running there.
        found = at_start.task_request(args)
        if found is not None and _let_go is not None:
            found[2][LET_GO_FIELD] = _let_go.count
        result = super().apply_async(func, args, *rest, **options)
        self._write_now()
        return result

    def _write_now(self) -> None:
        """Write the jobs waiting in the outbound buffer to processes that can start
        them, now. Celery writes a job at the loop's next turn (its writers are added
        when the poll starts): after everything else the loop does in this turn, which
        for a guarded end is the release's bookkeeping and the next ask, half a
        millisecond on the process's critical path (issue 36, docs/benchmarks.md). A
        process only: one leaving after its --max-tasks-per-child is not written to."""
        hub = getattr(self, "_baton_hub", None)
        write = getattr(hub, "consolidate_callback", None)
        if write is None or not self.outbound_buffer:
            return
        fds = [proc.inqW_fd for proc in list(self._pool) if self._can_start(proc)]
        if fds:
            write(fds)

    def flush(self) -> None:
        if _let_go is not None and self._state != billiard_pool.TERMINATE:
            _let_go.bump()  # before Celery drops the unaccepted jobs, so none runs after
            # A job its process accepted before the bump (its ACK sent, not read yet: it
            # was written within this turn of the loop, ``_write_now``) runs: read the
            # ACKs first, so that Celery keeps it (and acks its message) rather than
            # drop it and let its message come back (tests/transport/test_broker_writes.py).
            self._read_what_processes_sent()
        super().flush()

    def _read_what_processes_sent(self) -> None:
        """Read, without waiting, every message the pool processes have written to their
        result pipes, as the loop's next turn would have (resuming a message the loop
        had begun to read); a job READY meanwhile serves no waiting request."""
        hub = getattr(self, "_baton_hub", None)
        readers = getattr(hub, "readers", None)
        if readers is None:
            return
        on_change, self.on_change = self.on_change, None
        try:
            for proc in list(self._pool):
                fd = getattr(proc, "outqR_fd", None)
                if fd is None or fd not in self._fileno_to_outq:
                    continue
                for _ in range(READ_AT_FLUSH_MAX):
                    try:
                        if not proc.outq._reader.poll(0):
                            break
                        registered = readers.get(fd)
                        callback = registered[0] if registered else None
                        if inspect.isgenerator(callback):
                            next(callback)  # the message the loop had begun to read
                        else:
                            self.handle_result_event(fd)
                    except StopIteration:
                        continue
                    except (OSError, EOFError, ValueError):
                        break  # the process is gone: Celery's own handling follows
        finally:
            self.on_change = on_change


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
    global _let_go
    if _let_go is None:
        _let_go = LetGo()
    task_pool.Pool = ReadyAsynPool
    task_pool.BlockingPool = JudgingBlockingPool
    return None
