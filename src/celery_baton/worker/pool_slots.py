"""Pool slots: a request is asked of the gate only when a pool process can start it now.

The gate spends a rate token and grants a lease at the moment it answers; the user meets
the limit when the task body starts. If the two moments are apart (the request waits in
the pool's queue behind other work), a limit is judged at the wrong moment: a 2/s rate
admitted on schedule while every process is busy starts all at once when they free up,
and a lease is held by a request that cannot run while another worker could. So a
guarded request first takes a pool slot, then asks; granted, it goes to the pool on
that slot; refused, the slot goes back to the next waiter. A request that asks only for
the redelivery guard (its own id's run lease and done marker) limits nothing else and is
asked at once (``Delivery.at_start``).

Two ways to know that a process is free, chosen once per worker:

* ``SemaphoreSlots``: the prefork pool on the event loop (Celery's default). Celery
  puts a ``LaxBoundedSemaphore`` of the pool's size in front of the pool
  (``WorkController._process_task_sem``), released when a job ends. Guarded requests
  wait in the same FIFO as plain ones, so neither overtakes the other. A free semaphore
  is not yet a process that can start the request: Celery releases it when a process
  that ran its ``--max-tasks-per-child`` reports READY, and again when the pool joins
  that process, long before its replacement is up (issue 34). So a request given the
  semaphore asks only once the pool itself counts a process that can start it now
  (``worker/pool/prefork.py``: up, idle, not leaving, less the jobs waiting to be
  written and the requests already asking); until then it waits, holding the
  semaphore, and is served when the pool says a job ended or a process came up. A
  granted request goes to ``_process_task`` on the slot it holds. Plain requests wait
  in the same line for a process the same way (Celery would have written them to the
  pool's buffer, to wait there): one given a slot that Celery released twice cannot
  take the process a granted request was asked for.
* ``CountedSlots``: pools that queue inside themselves (threads, gevent, eventlet,
  solo, prefork without the event loop). Requests handed to the pool are counted until
  Celery calls them ready (``worker.state.reserved_requests``, and ``active_requests``,
  which a lost broker connection does not empty before Celery 5.7); the waiters are
  looked at again on a short timer while any wait.

Waiting for a slot costs no prefetch beyond what a plain request waiting for the pool
costs: the message stays unacknowledged and counts in the window, as Celery's own
requests in the semaphore do.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from celery.worker import state as worker_state

from celery_baton import internals

logger = logging.getLogger("celery_baton.worker")

#: How often ``CountedSlots`` looks for a free slot while requests wait for one.
POLL_INTERVAL = 0.02
#: A request that waited this long for a pool process while the pool ran nothing at all
#: is said (with what the pool says of its processes): that is never a wait for work to
#: end, but a pool that lost a process or a release.
STUCK_AFTER = 10.0


class PoolSlots(Protocol):
    def attach(self, task_pool: Any) -> None:
        """The worker's pool, started: what it says of its processes is used."""

    def acquire(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once a pool slot is reserved for the caller (now, or later
        on the consumer's loop or timer)."""

    def give_back(self) -> None:
        """A reserved slot the caller will not use (the gate refused for now)."""

    def run(self, request: Any) -> None:
        """Hand ``request`` to the pool on the slot reserved for it."""

    def plain(self, request: Any) -> None:
        """Hand a request that asks nothing to Celery, as without celery-baton."""

    def restart(self) -> None:
        """A consumer restart (a lost broker connection): what these slots keep on the
        consumer's timer is armed again. Celery 5.3 clears that timer
        (``Consumer.on_close``: ``self.timer.clear()``); 5.6 and 5.7 keep it."""


class SemaphoreSlots:
    """The prefork pool's own semaphore, and its processes (see the module docstring)."""

    def __init__(
        self,
        semaphore: Any,
        process_task: Callable[[Any], Any],
        handle: Any,
        timer: Any = None,
    ) -> None:
        self.semaphore = semaphore
        self.process_task = process_task
        self.handle = handle
        self.timer = timer
        self._startable: Callable[[], int] | None = None  # the pool's count, once known
        self._waiters: deque[Callable[[], None]] = deque()  # hold the semaphore
        self._reserved = 0  # slots given to waiters, not yet run or given back
        self._pool: Any = None
        self._stuck_check: Any = None  # the timer entry of _look_for_a_stuck_wait
        self._idle_since: float | None = None  # requests wait, the pool runs nothing
        self._said_stuck = False

    def attach(self, task_pool: Any) -> None:
        """The started pool: its processes say when a request can start (prefork.py)."""
        pool: Any = getattr(task_pool, "_pool", None)
        startable = getattr(pool, "startable", None)
        if callable(startable):
            self._startable = startable
            self._pool = pool
            pool.on_change = self._serve
            self._serve()
            self._arm_stuck_check()

    def restart(self) -> None:
        if self._pool is not None:
            self._arm_stuck_check()  # cleared with the timer on Celery 5.3: never said

    def _arm_stuck_check(self) -> None:
        if self.timer is None:
            return
        if self._stuck_check is not None:
            self._stuck_check.cancel()  # a timer that was kept (Celery 5.6+): not twice
        self._stuck_check = self.timer.call_repeatedly(STUCK_AFTER / 2, self._look_for_a_stuck_wait)

    def _look_for_a_stuck_wait(self) -> None:
        """Say once when requests waited ``STUCK_AFTER`` s for a process of a pool that
        ran nothing meanwhile (on the timer; nothing may escape)."""
        try:
            # Requests waiting for a process, and jobs handed to the pool that no process
            # took (a job is in the pool's cache from its hand-over; accepted, it runs).
            unwritten = len(getattr(self._pool, "outbound_buffer", ()))
            waiting = len(self._waiters) + len(getattr(self.semaphore, "_waiting", ())) + unwritten
            jobs = list(getattr(self._pool, "_cache", {}).values())
            if not waiting or any(getattr(job, "_accepted", True) for job in jobs):
                self._idle_since, self._said_stuck = None, False
                return
            now = time.monotonic()
            if self._idle_since is None:
                self._idle_since = now
            elif now - self._idle_since >= STUCK_AFTER and not self._said_stuck:
                self._said_stuck = True
                describe = getattr(self._pool, "describe", None)
                logger.error(
                    "baton: %d request(s) waited %.0fs for a pool process while the pool ran "
                    "nothing: semaphore %s, %d waiting for a process, %d slot(s) reserved, "
                    "%d handed to the pool and not written to a process, %s start now; %s",
                    waiting,
                    now - self._idle_since,
                    getattr(self.semaphore, "value", "?"),
                    len(self._waiters),
                    self._reserved,
                    unwritten,
                    self._startable() if self._startable is not None else "?",
                    describe() if callable(describe) else "",
                )
        except Exception:
            logger.exception("baton: looking at the requests waiting for a pool process failed")

    def acquire(self, callback: Callable[[], None]) -> None:
        self.semaphore.acquire(self._holds_semaphore, callback)

    def _holds_semaphore(self, callback: Callable[[], None]) -> None:
        # Given the semaphore (now, or later by Celery's release): now a process.
        self._waiters.append(callback)
        self._serve()

    def give_back(self) -> None:
        # Lax: a release after Celery cleared the semaphore (lost connection) is
        # bounded by the pool's size.
        self._reserved = max(0, self._reserved - 1)
        self.semaphore.release()
        self._serve()

    def run(self, request: Any) -> None:
        self._reserved = max(0, self._reserved - 1)
        self.process_task(request)

    def plain(self, request: Any) -> None:
        if self._startable is None:
            self.handle(request)  # Celery's own path: _process_task_sem
            return
        # In the same line as the guarded requests, and to a process that can start it:
        # a plain job given a slot Celery released twice must not take the process a
        # granted request was asked for.
        self.semaphore.acquire(self._holds_semaphore, functools.partial(self._run_kept, request))

    def _run_kept(self, request: Any) -> None:
        """A request served from the line, once a process can start it: unless Celery
        dropped it meanwhile. A lost broker connection empties Celery's reserved
        requests (``Consumer.on_close``) and its semaphore, but not this line; the
        message comes back from the broker, so the request must not run here too (a
        plain call ran twice; a granted one, whose keys were given back with the
        connection, ran without them)."""
        if request not in worker_state.reserved_requests:
            logger.info(
                "%s[%s] left to the broker: Celery dropped it (the broker connection was "
                "lost) while it waited for a pool process",
                request.name,
                request.id,
            )
            self.give_back()
            return
        self.run(request)

    def _free(self) -> int:
        if self._startable is None:
            return len(self._waiters)  # not attached (yet): the semaphore alone
        return self._startable() - self._reserved

    def _serve(self) -> None:
        while self._waiters and self._free() > 0:
            self._reserved += 1
            self._waiters.popleft()()


class CountedSlots:
    """Slots counted against the pool's size (see the module docstring)."""

    def __init__(self, limit: int, handle: Callable[[Any], Any], timer: Any) -> None:
        self.limit = max(1, limit)
        self.handle = handle
        self.timer = timer
        self._in_pool: list[Any] = []
        self._reserved = 0  # slots given to waiters, not yet run or given back
        self._waiters: deque[Callable[[], None]] = deque()
        self._poll_entry: Any = None  # the armed poll's timer entry (None: none armed)
        self._startable: Callable[[], int] | None = None  # a prefork pool's count

    def attach(self, task_pool: Any) -> None:
        """A prefork pool without Celery's semaphore (``--without-putlocks``) counts its
        processes too: a process that is leaving does not count (pool/prefork.py)."""
        pool: Any = getattr(task_pool, "_pool", None)
        startable = getattr(pool, "startable", None)
        if callable(startable):
            self._startable = startable
            pool.on_change = self._serve

    def _free(self) -> int:
        # A request leaves the pool when Celery calls it ready: both sets drop it then.
        # Before Celery 5.7 a lost broker connection empties reserved_requests, running
        # requests included (Consumer.on_close), while they still hold their threads.
        reserved, active = worker_state.reserved_requests, worker_state.active_requests
        self._in_pool = [r for r in self._in_pool if r in reserved or r in active]
        free = self.limit - len(self._in_pool) - self._reserved
        if self._startable is not None:
            free = min(free, self._startable() - self._reserved)
        return free

    def acquire(self, callback: Callable[[], None]) -> None:
        if not self._waiters and self._free() > 0:
            self._reserved += 1
            callback()
            return
        self._waiters.append(callback)
        self._poll()

    def give_back(self) -> None:
        self._reserved = max(0, self._reserved - 1)
        self._serve()

    def run(self, request: Any) -> None:
        self._reserved = max(0, self._reserved - 1)
        self._in_pool.append(request)
        self.handle(request)

    def plain(self, request: Any) -> None:
        self._in_pool.append(request)
        self.handle(request)

    def _serve(self) -> None:
        while self._waiters and self._free() > 0:
            self._reserved += 1
            self._waiters.popleft()()

    def restart(self) -> None:
        # The armed poll went with a cleared timer (Celery 5.3), and its flag stayed up:
        # a waiter was then looked at again only when a slot was given back, and a
        # slot freed by Celery (a run that ended) was never seen.
        if self._poll_entry is not None:
            self._poll_entry.cancel()  # a timer that was kept (Celery 5.6+): not twice
        self._poll_entry = None
        if self._waiters:
            self._poll()

    def _poll(self) -> None:
        if self._poll_entry is None:
            self._poll_entry = self.timer.call_after(POLL_INTERVAL, self._on_poll, priority=5)

    def _on_poll(self) -> None:
        # kombu's timer swallows exceptions: a waiter must never be lost.
        self._poll_entry = None
        try:
            self._serve()
        except Exception:
            logger.exception("baton: handing a pool slot to a waiting request failed")
        if self._waiters:
            self._poll()


def pool_slots(consumer: Any, handle: Callable[[Any], Any]) -> PoolSlots:
    """The slots of ``consumer``'s pool; ``handle`` is Celery's ``on_task_request``."""
    controller: Any = getattr(consumer, "controller", None)
    # Celery guards the pool with its semaphore only when it hands requests through
    # _process_task_sem (prefork on the event loop, with pool_putlocks).
    process_task = internals.semaphore_process_task(controller, handle)
    if process_task is not None:
        return SemaphoreSlots(
            controller.semaphore, process_task, handle, getattr(consumer, "timer", None)
        )
    pool = getattr(consumer, "pool", None)
    limit = getattr(pool, "limit", None) or getattr(controller, "concurrency", None) or 1
    return CountedSlots(
        _size(limit, getattr(controller, "concurrency", None)), handle, consumer.timer
    )


def _size(limit: Any, concurrency: Any) -> int:
    """The pool's size as a number; a size that is not one (a test's mock pool) never
    breaks the consumer: the worker's concurrency, else 1, said once per consumer."""
    try:
        return int(limit)
    except (TypeError, ValueError):
        fallback = concurrency if isinstance(concurrency, int) and concurrency > 0 else 1
        logger.warning(
            "baton: the pool size %r is not a number; counting %d pool slot(s)", limit, fallback
        )
        return fallback
