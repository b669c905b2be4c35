"""Admission in the worker's consumer, before the pool.

``Admission`` replaces the consumer's ``on_task_request``: every delivered request
(plain, after its ETA, after Celery's own rate-limit bucket) reaches it before the
pool. A request of a task with a policy asks the gate once:

* granted: it goes to the pool holding its leases (released by ``worker.request``);
* denied by an exclusive key with ``exclusive_conflict="skip"``: acked, not run,
  logged, signalled and recorded as a ``TaskSkipped`` result;
* denied by a task id that already finished (redelivery guard): acked, not run, logged;
* otherwise it is HELD here, in memory, occupying no pool slot. Held requests wait in
  one FIFO per key and are retried when the gate said they may pass (``retry_after``,
  with jitter so several workers do not stampede) or at once when a lease on that key
  is released (a pub/sub notice). Holding raises the prefetch count like an ETA task
  does, so held requests do not starve the worker of other work; past a cap or a time
  horizon they are handed back to the broker unchanged (``reject(requeue=True)``: same
  id, headers and retry count; never ``task.retry``).

When the store is down, ``baton_on_store_error="hold"`` holds the request and retries
with back-off (nothing runs unguarded); ``"run"`` runs it unguarded, logged.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import random
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from celery.utils.time import rate as parse_celery_rate
from celery.worker import state as worker_state

from celery_baton import metrics, signals
from celery_baton.errors import BatonError, KeySpecError, StoreUnavailable, TaskSkipped
from celery_baton.gate import Decision, Release, gate_call, parse_decision
from celery_baton.leases import LeaseBook, Releaser, new_owner
from celery_baton.policy import RunPlan, TaskPolicy
from celery_baton.store.channel import BlockingChannel, PipelinedChannel
from celery_baton.store.connection import STORE_ERRORS
from celery_baton.worker.context import FENCE_FIELD
from celery_baton.worker.request import attach

if TYPE_CHECKING:
    from celery_baton.baton import Baton

logger = logging.getLogger("celery_baton.worker")

STORE_KEY = "<store>"  # the wait queue of requests held because the store is down
BACKOFF_START = 0.25
BACKOFF_MAX = 10.0
SKIP_GRACE = 0.25  # seconds a duplicate waits for a release in flight before it is skipped
PROBE_INTERVAL = 1.0  # seconds between PINGs while releases wait for the store


class ReleaseLog:
    """When each lease key's release was last announced, remembered for ``memory`` s.

    A denial can be on its way back to the loop while the release that follows it is
    already announced; the log lets the denied request retry at once instead of
    sleeping through a notice it missed. Written by the notice listener thread, read on
    the loop (single dict operations, atomic under the GIL). Keys are kept in the order
    they were noted, a key noted again moving to the end, so the oldest are always at
    the front: expiry pops from there, O(1) amortised per notice however many keys are
    released. ``most`` bounds memory when notices come faster than ``memory`` expires.
    """

    def __init__(self, memory: float = 10.0, most: int = 65536) -> None:
        self.memory = memory
        self.most = most
        self._at: OrderedDict[str, float] = OrderedDict()

    def note(self, key: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        at = self._at
        at[key] = now
        at.move_to_end(key)
        horizon = now - self.memory
        while at:
            oldest = next(iter(at.values()))
            if oldest > horizon and len(at) <= self.most:
                break
            at.popitem(last=False)

    def at(self, key: str) -> float:
        """When ``key``'s release was last announced (monotonic; -1.0: not lately)."""
        return self._at.get(key, -1.0)

    def __len__(self) -> int:
        return len(self._at)


@dataclass(eq=False)
class Held:
    """A request the consumer is deciding about, or holding."""

    request: Any
    policy: TaskPolicy
    plan: RunPlan
    since: float = field(default_factory=time.monotonic)
    held: bool = False
    counted: bool = False  # raised the prefetch count (False past baton_hold_max)
    backoff: float = BACKOFF_START
    skip_after: float | None = None
    asking: bool = False  # a gate call for it is in flight
    asked_at: float = 0.0  # when the last gate call for it was sent
    generation: int = 0
    queue_key: str | None = None  # the wait queue it sits in
    celery_rate: float | None = None  # Celery's rate_limit its plan was made with


@dataclass
class Wait:
    key: str
    delay: float
    # Jitter spreads workers that a release notice wakes together; a rate wait must not
    # have it: strict GCRA loses every microsecond a waiter comes late.
    jitter: bool = True


class Admission:
    """The consumer's ``on_task_request``; see the module docstring."""

    def __init__(self, baton: Baton, consumer: Any, handle: Callable[[Any], Any]) -> None:
        self.baton = baton
        self.consumer = consumer
        self.handle = handle
        self.hostname: str = consumer.hostname
        self._queues: dict[str, deque[Held]] = {}
        self._timers: dict[str, tuple[float, Any]] = {}
        self._lock = threading.RLock()
        self._wakeups: deque[str] = deque()
        self._wake_w: int | None = None
        self._wake_fds: tuple[int, int] | None = None
        self._rate_cache: dict[Any, float | None] = {}
        self._released = ReleaseLog()
        self._unsent: list[Release] = []  # releases waiting for the store to answer
        self._probe_armed = False
        self._loop_thread = threading.get_ident()  # consumers are built on their loop
        self.book: LeaseBook | None = None
        self.releaser: Releaser | None = None
        self.channel: BlockingChannel | PipelinedChannel | None = None
        self.generation = 0  # bumped when held requests are forgotten (connection lost)
        self.held_count = 0
        self.counted = 0  # held requests that raised the prefetch count
        self._cap_warned = -1e9
        self._store_down_until = 0.0
        self.stats = {"admitted": 0, "held": 0, "skipped": 0, "handed_back": 0, "throttled": 0}

    # -- entry point ----------------------------------------------------------------

    def __call__(self, request: Any) -> Any:
        policy = self.baton.policy_for(request.task)
        if policy is None:
            return self.handle(request)
        celery_rate = None
        if policy.rate_from_celery:
            celery_rate = self._celery_rate(request.task)
            if celery_rate is None and policy.celery_rate_only:
                return self.handle(request)  # no rate_limit now: nothing to ask
        try:
            plan = self._plan(request, policy, celery_rate)
        except KeySpecError as exc:
            return self._refuse(request, exc)
        if not plan.conditions:  # only a unique key to free when it finishes
            attach(request, self, policy, plan)
            return self.handle(request)
        with self._lock:
            held = Held(request, policy, plan, generation=self.generation, celery_rate=celery_rate)
            self._ask(held, self._enqueue)
        return None

    def _plan(self, request: Any, policy: TaskPolicy, celery_rate: float | None) -> RunPlan:
        return policy.plan(
            self.baton.names,
            task_id=request.id,
            owner=new_owner(request.id, self.hostname),
            args=request.args,
            kwargs=request.kwargs,
            celery_rate=celery_rate,
        )

    def _celery_rate(self, task: Any) -> float | None:
        """Celery's ``rate_limit`` of ``task`` in starts per second (None: no limit).

        Read at every admission: `celery control rate_limit` changes it on every worker,
        for any task, also one that had none when the worker started. Parsed the way
        Celery parses it, so that a value Celery accepted is never refused here."""
        value = task.rate_limit
        try:
            return self._rate_cache[value]
        except KeyError:
            pass
        per_second: float | None = None
        try:
            per_second = float(parse_celery_rate(value)) or None
        except (ValueError, KeyError, TypeError):
            logger.error("rate_limit %r of %s is not a rate; not limiting it", value, task.name)
        if per_second is not None and not 0 < per_second < float("inf"):
            per_second = None
        self._rate_cache[value] = per_second
        return per_second

    # -- one decision ---------------------------------------------------------------

    def _ask(self, held: Held, then: Callable[[Held, Wait], None]) -> None:
        """Ask the gate for ``held``; when it must wait, ``then(held, wait)`` queues it.

        The answer may come later (the store channel is pipelined on the event loop):
        a request is never asked twice at once (``asking``).
        """
        request = held.request
        if held.held and request.revoked():  # revoked or expired while held: Celery acks it
            self._unhold(held)
            return
        now = time.monotonic()
        elapsed = now - held.since
        if held.held and elapsed >= self.baton.hold_horizon:
            self._hand_back(held, f"held {elapsed:.0f}s, the horizon")
            return
        if not held.held and now < self._store_down_until:
            # The store failed moments ago: do not wait on it again for every new
            # request; queue behind the request that is probing it.
            self._answered(held, then, StoreUnavailable("the store failed moments ago"))
            return
        if held.policy.rate_from_celery and self._celery_rate(request.task) != held.celery_rate:
            # `celery control rate_limit` changed it while this request was held: ask
            # with the rate that holds now (lifted: it may not need the gate at all).
            held.celery_rate = self._celery_rate(request.task)
            with contextlib.suppress(KeySpecError):  # built once already: cannot fail
                held.plan = self._plan(request, held.policy, held.celery_rate)
            if not held.plan.conditions:
                self._start(held, Decision(True))
                return
        held.asking = True
        held.asked_at = time.monotonic()
        keys, args = gate_call(
            held.plan.conditions, held.plan.owner, held.policy.lease_ttl, held.plan.reserve
        )
        self._channel().call("gate", keys, args, lambda reply: self._answered(held, then, reply))

    def _channel(self) -> BlockingChannel | PipelinedChannel:
        if self.channel is None:
            self.channel = BlockingChannel(self.baton.store)
        return self.channel

    def _answered(self, held: Held, then: Callable[[Held, Wait], None], reply: Any) -> None:
        # Runs on the event loop when the store answered; kombu swallows exceptions
        # there, so none may escape: a request must never be lost.
        try:
            with self._lock:
                sent, held.asking = held.asking, False
                if isinstance(reply, StoreUnavailable):
                    if sent:
                        self._give_back_lost(held)
                elif not isinstance(reply, BaseException):
                    self._store_answered()
                if held.generation != self.generation:
                    self._forgotten(held, reply)
                    return
                outcome = self._outcome(held, reply)
                if isinstance(outcome, Wait):
                    then(held, outcome)
        except Exception:
            logger.exception(
                "baton: deciding %s[%s] failed; holding it", held.request.name, held.request.id
            )
            with self._lock:
                then(held, Wait(STORE_KEY, BACKOFF_MAX))

    def _forgotten(self, held: Held, reply: Any) -> None:
        """The answer for a request dropped meanwhile (the broker connection was lost and
        its message goes to another worker): give back whatever the gate granted (a lost
        answer was given back in ``_answered`` already)."""
        if isinstance(reply, BaseException) or reply[0] != 1:
            return
        leases = tuple(lease.key for lease in held.plan.leases)
        if leases:
            self._send_release(Release(leases, held.plan.owner))

    def _give_back_lost(self, held: Held) -> None:
        """The gate call for ``held`` got no answer (the channel broke or timed out), but
        the store may still execute it and grant its leases to this owner, who will
        never run with them. Release them once the store answers again (owner-compared:
        harmless if nothing was granted), and ask again, if at all, as a new owner, so
        that this release can never free what a later answer grants."""
        plan = held.plan
        if not plan.leases:
            return
        release = Release(tuple(lease.key for lease in plan.leases), plan.owner)
        held.plan = plan.with_owner(new_owner(held.request.id, self.hostname))
        if isinstance(self.channel, PipelinedChannel):
            self._send_when_answered(release)
        elif self.book is not None:
            store, gate = self.baton.store, self.baton.gate

            def give_back() -> None:
                # A reply to PING shows the store runs again and has read what it was
                # sent before; the release then arrives after the lost call.
                try:
                    store.client.ping()
                except STORE_ERRORS as exc:
                    raise store.unavailable(exc) from exc
                gate.release_many([release])

            self.book.retry_later(give_back)

    def _outcome(self, held: Held, reply: Any) -> Wait | None:
        """What to do with the gate's reply. None: the request left (started, skipped)."""
        request = held.request
        if isinstance(reply, BaseException):
            if not isinstance(reply, StoreUnavailable):
                raise reply
            delay = held.backoff
            now = time.monotonic()
            if self._store_down_until <= now:
                self._store_down_until = now + delay
            if self.baton.settings.on_store_error == "run":
                logger.warning(
                    "store unavailable, running %s[%s] UNGUARDED (baton_on_store_error='run'): %s",
                    request.name,
                    request.id,
                    reply,
                )
                self._start(held, Decision(True), guarded=False)
                return None
            held.backoff = min(BACKOFF_MAX, held.backoff * 2)
            logger.warning(
                "store unavailable, holding %s[%s], retry in %.2fs: %s",
                request.name,
                request.id,
                delay,
                reply,
            )
            return Wait(STORE_KEY, delay)
        held.backoff = BACKOFF_START
        self._store_down_until = 0.0
        result = parse_decision(held.plan.conditions, reply)
        if result.granted:
            self._start(held, result)
            return None
        return self._denied(held, result)

    def _denied(self, held: Held, decision: Decision) -> Wait | None:
        request, plan, policy = held.request, held.plan, held.policy
        condition = decision.denied_by
        assert condition is not None
        own_copy = decision.holder_task_id == request.id
        if condition.kind == "D":
            self._skip(
                held,
                "already-run",
                condition.key,
                decision.holder,
                f"task id {request.id} already finished; this redelivered copy is not run",
            )
            return None
        if (
            condition.key == plan.exclusive_key
            and not own_copy
            and policy.exclusive_conflict == "skip"
        ):
            grace = self._grace_left(held)
            if grace > 0:
                return Wait(condition.key, min(grace, max(decision.retry_after, 0.001)))
            label = plan.labels.get(condition.key, "")
            self._skip(
                held,
                "exclusive",
                condition.key,
                decision.holder_task_id,
                f"exclusive key {label or '(task)'} of {request.name} is held by task "
                f"{decision.holder_task_id}; this run is skipped",
            )
            return None
        if condition.kind == "R":
            self.stats["throttled"] += 1
            metrics.throttled.labels(held.request.name).inc()
            signals.task_throttled.send(
                sender=held.request.task,
                request=held.request,
                key=condition.key,
                retry_after=decision.retry_after,
            )
        # A lease held by a copy of this very task id (its own retry, or a redelivery
        # while the first copy still runs) always waits: it is freed in milliseconds,
        # or the first copy finishes and this one is dropped as already run.
        if condition.kind == "R" and plan.reserve:
            # Ask again just inside the reservation window: the slot is then reserved
            # before it comes, however late this worker wakes.
            early = decision.retry_after - plan.reserve * 0.9
            return Wait(condition.key, max(early, 0.0001), jitter=False)
        return Wait(condition.key, max(decision.retry_after, 0.0001), jitter=condition.kind != "R")

    def _grace_left(self, held: Held) -> float:
        """How long a duplicate still waits before it is skipped (0: skip it now).

        A run's result is stored by the pool child before the main process releases its
        lease, so a caller that waited for the result and publishes again at once can
        find the key still held for a few milliseconds. Skipping that run would be
        wrong: the first run is over. The release notice wakes it at once; a run that
        really is still going makes it skip when the grace ends.
        """
        now = time.monotonic()
        if held.skip_after is None:
            held.skip_after = now + SKIP_GRACE
        return max(0.0, held.skip_after - now)

    # -- outcomes -------------------------------------------------------------------

    def _start(self, held: Held, decision: Decision, *, guarded: bool = True) -> None:
        request = held.request
        if guarded:
            attach(request, self, held.policy, held.plan)
            if self.book is not None:
                self.book.add(held.plan.owner, held.plan.leases)
            if decision.fence:
                request.request_dict[FENCE_FIELD] = decision.fence
        self.stats["admitted"] += 1
        metrics.admissions.labels(request.name).inc()
        if decision.start_after > 0:
            # A reserved rate slot: hold it (no pool slot) until the slot's instant.
            self._remove(held)
            if not held.held:
                self._enqueue_reserved(held)
            self.consumer.timer.call_after(
                decision.start_after, self._dispatch, (held,), priority=5
            )
            return
        self._unhold(held)
        self.handle(request)

    def _enqueue_reserved(self, held: Held) -> None:
        """Count a reserved request as held (prefetch, stats) without a wait queue."""
        held.held = True
        self.held_count += 1
        if self.counted < self.baton.settings.hold_max:
            held.counted = True
            self.counted += 1
            self.consumer.qos.increment_eventually()

    def _dispatch(self, held: Held) -> None:
        try:
            with self._lock:
                if held.generation != self.generation:
                    # Forgotten (the connection was lost; the broker redelivers it): it
                    # will not run here, so give back what it was granted.
                    self.finish(held.request, held.policy, held.plan, final=False)
                    return
                self._unhold(held)
                self.handle(held.request)
        except Exception:
            logger.exception("baton: dispatching %s[%s] failed", held.request.name, held.request.id)

    def _skip(self, held: Held, reason: str, key: str, holder: str, message: str) -> None:
        request = held.request
        self._unhold(held)
        self.stats["skipped"] += 1
        metrics.skips.labels(request.name, reason).inc()
        logger.warning("%s[%s] skipped: %s", request.name, request.id, message)
        signals.task_skipped.send(
            sender=request.task, request=request, key=key, holder=holder, reason=reason
        )
        task = request.task
        if reason == "exclusive" and not task.ignore_result:
            # A clear final state for whoever waits on the result; no errbacks: the
            # work is being done by the holder.
            task.backend.mark_as_failure(
                request.id,
                TaskSkipped(message, key, holder),
                request=request._context,
                store_result=True,
                call_errbacks=False,
            )
        if held.plan.unique_key and reason == "exclusive":
            self._release_unique(held)
        worker_state.task_ready(request)
        request.acknowledge()

    def _refuse(self, request: Any, exc: BatonError) -> None:
        """A request whose key cannot be built: fail it loudly; never run it unguarded."""
        logger.error("%s[%s] refused: %s", request.name, request.id, exc)
        signals.task_skipped.send(
            sender=request.task, request=request, key="", holder="", reason="invalid-key"
        )
        request.task.backend.mark_as_failure(
            request.id, exc, request=request._context, store_result=True
        )
        worker_state.task_ready(request)
        request.acknowledge()

    def _hand_back(self, held: Held, why: str) -> None:
        request = held.request
        self._unhold(held)
        self.stats["handed_back"] += 1
        metrics.handed_back.labels(request.name).inc()
        logger.warning("%s[%s] handed back to the broker: %s", request.name, request.id, why)
        signals.task_handed_back.send(sender=request.task, request=request, reason=why)
        worker_state.task_ready(request)
        request.reject(requeue=True)

    def _release_unique(self, held: Held) -> None:
        self.release_unique(held.plan.unique_key or "", held.request.id)

    def release_unique(self, key: str, task_id: str) -> None:
        """Free ``task_id``'s claim on unique ``key`` without waiting for the store
        (on the consumer's loop): sent like a release, retried in the background."""
        self._send_release(Release((), "", unique_key=key, unique_owner=task_id))

    # -- holding --------------------------------------------------------------------

    def _enqueue(self, held: Held, wait: Wait) -> None:
        if not held.held:
            held.held = True
            self.held_count += 1
            self.stats["held"] += 1
            metrics.holds.labels(held.request.name).inc()
            metrics.held_now.set(self.held_count)
            if self.counted < self.baton.settings.hold_max:
                # Like an ETA task: a held request must not use up the prefetch window,
                # or the worker would stop receiving the work it could run.
                held.counted = True
                self.counted += 1
                self.consumer.qos.increment_eventually()
            else:
                # Past the cap, held requests keep their prefetch slot: the window fills
                # and the broker stops sending to this worker, so memory stays bounded
                # (handing them back would make Redis redeliver them at once, a spin).
                self._warn_cap()
            signals.task_held.send(
                sender=held.request.task, request=held.request, key=wait.key, retry_after=wait.delay
            )
            logger.info(
                "%s[%s] held for %s, retry in %.3fs",
                held.request.name,
                held.request.id,
                wait.key,
                wait.delay,
            )
        if held.queue_key != wait.key:
            self._remove(held)
            self._queues.setdefault(wait.key, deque()).append(held)
            held.queue_key = wait.key
        delay = wait.delay
        if self._released.at(wait.key) >= held.asked_at:
            delay = 0.0  # released after we asked: the notice came before the denial
        self._arm(wait.key, delay, jitter=wait.jitter)

    def _unhold(self, held: Held) -> None:
        self._remove(held)
        if held.held:
            held.held = False
            self.held_count -= 1
            metrics.held_now.set(self.held_count)
            metrics.hold_seconds.labels(held.request.name).observe(time.monotonic() - held.since)
            if held.counted:
                held.counted = False
                self.counted -= 1
                self.consumer.qos.decrement_eventually()

    def _warn_cap(self) -> None:
        now = time.monotonic()
        if now - self._cap_warned > 10:
            self._cap_warned = now
            logger.warning(
                "%d requests held, past baton_hold_max=%d: the rest keep their prefetch "
                "slots, so this worker receives no more messages until some leave",
                self.held_count,
                self.baton.settings.hold_max,
            )

    def _arm(self, key: str, delay: float, *, jitter: bool = True) -> None:
        delay = min(delay, self.baton.hold_horizon)  # never sleep past the horizon
        if jitter:  # workers woken together retry at different moments
            delay = delay * (1 + random.random() * 0.05) + random.random() * 0.005
        due = time.monotonic() + delay
        armed = self._timers.get(key)
        if armed is not None:
            if armed[0] <= due:
                return
            armed[1].cancel()
        entry = self.consumer.timer.call_after(delay, self._on_timer, (key,), priority=5)
        self._timers[key] = (due, entry)

    def _on_timer(self, key: str) -> None:
        # kombu's timer swallows exceptions: catch everything so no request is lost.
        try:
            with self._lock:
                self._timers.pop(key, None)
                self._drain(key)
        except Exception:
            logger.exception("baton: draining %s failed; retrying", key)
            with self._lock:
                self._arm(key, 1.0)

    def _drain(self, key: str) -> None:
        """Ask for the head of ``key``'s queue. Its answer re-arms the timer (it still
        waits), moves it to another queue, or lets it leave, which drains on."""
        queue = self._queues.get(key)
        if not queue:
            self._drop_queue(key)
            return
        head = queue[0]
        if not head.asking:
            self._ask(head, self._enqueue)

    def _remove(self, held: Held) -> None:
        key, held.queue_key = held.queue_key, None
        if key is None:
            return
        queue = self._queues.get(key)
        if queue is None:
            return
        was_head = bool(queue) and queue[0] is held
        with contextlib.suppress(ValueError):
            queue.remove(held)
        if not queue:
            self._drop_queue(key)
        elif was_head:
            # The next one may pass now (a slot, a lease): ask on the next loop turn,
            # not recursively from inside this answer.
            self.consumer.timer.call_after(0, self._on_timer, (key,))

    def _drop_queue(self, key: str) -> None:
        self._queues.pop(key, None)
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer[1].cancel()

    # -- wake-ups from the notice listener thread -----------------------------------

    def install_wakeup(self, consumer: Any) -> None:
        """Let another thread wake a key's queue on the consumer's own loop.

        Called at every consumer start: after a lost broker connection Celery resets
        the event loop, which drops every file descriptor registered on it (and the
        timers: the probe for unsent releases is armed again)."""
        self.consumer = consumer
        self._loop_thread = threading.get_ident()
        self._probe_armed = False
        if self._unsent:
            self._arm_probe()
        hub = getattr(consumer, "hub", None)
        old, self._wake_fds = self._wake_fds, None
        if old is not None:
            if hub is not None:
                with contextlib.suppress(Exception):  # gone already if the loop was reset
                    hub.remove_reader(old[0])
            for fd in old:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._wake_w = None
        if hub is not None:
            r, w = os.pipe()
            os.set_blocking(r, False)
            os.set_blocking(w, False)
            self._wake_fds = (r, w)
            self._wake_w = w
            hub.add_reader(r, self._on_wake_pipe, r)

    def wake(self, key: str) -> None:
        """Called from another thread when ``key`` was released."""
        # Remembered even when nobody waits here yet: a denial may be on its way back
        # to this loop while the release that follows it is already announced.
        self._released.note(key)
        if key not in self._queues:
            return
        if self._wake_w is not None:
            self._wakeups.append(key)
            with contextlib.suppress(BlockingIOError):
                os.write(self._wake_w, b"!")
        else:  # timer2 runs its own thread and is thread-safe
            self.consumer.timer.call_after(0, self._on_timer, (key,))

    def _on_wake_pipe(self, fd: int) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(fd, 4096)
        keys = set()
        while self._wakeups:
            keys.add(self._wakeups.popleft())
        for key in keys:
            self._on_timer(key)

    def forget_held(self) -> int:
        """Drop every held request (the connection is gone; the broker redelivers them)."""
        with self._lock:
            count, self.held_count, self.counted = self.held_count, 0, 0
            self.generation += 1
            for _, entry in self._timers.values():
                entry.cancel()
            self._timers.clear()
            self._queues.clear()
            return count

    def held_by_key(self, top: int = 20) -> dict[str, int]:
        with self._lock:
            sizes = sorted(((len(q), k) for k, q in self._queues.items()), reverse=True)
        return {key: size for size, key in sizes[:top]}

    # -- release (Finisher) ---------------------------------------------------------

    def finish(self, request: Any, policy: TaskPolicy, plan: RunPlan, *, final: bool) -> None:
        """Give back a run's leases; when final, mark its id done and free its unique key."""
        if self.book is not None:
            self.book.remove(plan.owner)
        done_key = plan.done_key if final else None
        unique_key = plan.unique_key if final and policy.unique_until == "finished" else None
        if not (plan.leases or done_key or unique_key):
            return
        release = Release(
            tuple(lease.key for lease in plan.leases),
            plan.owner,
            done_key,
            policy.redelivery_retention,
            unique_key,
            request.id,
        )
        self._send_release(release)

    def _send_release(self, release: Release) -> None:
        if isinstance(self.channel, PipelinedChannel):
            # Written to the store's socket now; the event loop reads the answer later.
            keys, args = release.script_call(self.baton.names.notice_channel)

            def answered(reply: Any) -> None:
                if isinstance(reply, BaseException):
                    logger.warning("release failed, retrying in the background: %s", reply)
                    self.retry_release(release)
                else:
                    self._store_answered()

            self.channel.call("release", keys, args, answered)
            return
        if self.releaser is not None:
            self.releaser.submit(release)  # sent from a thread, batched
            return
        try:
            if time.monotonic() < self._store_down_until:
                raise StoreUnavailable("the store failed moments ago; not asked again yet")
            self.baton.gate.release_many([release])
        except StoreUnavailable as exc:
            now = time.monotonic()
            if self._store_down_until <= now:
                self._store_down_until = now + BACKOFF_START
            logger.warning("release failed, retrying in the background: %s", exc)
            self.retry_release(release)

    def retry_release(self, release: Release) -> None:
        """A release the store did not answer: send it again once it does."""
        if isinstance(self.channel, PipelinedChannel) and self._on_loop():
            self._send_when_answered(release)
        elif self.book is not None:
            gate = self.baton.gate
            self.book.retry_later(lambda: gate.release_many([release]))

    def _on_loop(self) -> bool:
        return threading.get_ident() == self._loop_thread

    def _send_when_answered(self, release: Release) -> None:
        """Keep ``release`` until the store answers something (a gate call, a release,
        or the PING sent every second meanwhile), then send it on the channel: never a
        wait on the loop, and never ahead of a call the store had buffered."""
        self._unsent.append(release)
        self._arm_probe()

    def _arm_probe(self) -> None:
        if not self._probe_armed:
            self._probe_armed = True
            self.consumer.timer.call_after(PROBE_INTERVAL, self._probe, priority=5)

    def _probe(self) -> None:
        # kombu's timer swallows exceptions: catch everything so no release is lost.
        try:
            self._probe_armed = False
            if self._unsent and isinstance(self.channel, PipelinedChannel):
                self.channel.ping(self._probed)
        except Exception:
            logger.exception("baton: probing the store failed; trying again")
            self._arm_probe()

    def _probed(self, reply: Any) -> None:
        if isinstance(reply, BaseException):
            self._arm_probe()
        else:
            self._store_answered()

    def _store_answered(self) -> None:
        """The store answered: send the releases that waited for it."""
        if self._unsent:
            unsent, self._unsent = self._unsent, []
            for release in unsent:
                self._send_release(release)  # failing again: back into _unsent

    def hand_over_unsent(self) -> None:
        """At shutdown: releases still waiting for the store go to the lease book, which
        sends them (blocking, from its own thread or the shutdown) before it stops."""
        unsent, self._unsent = self._unsent, []
        if self.book is not None:
            gate = self.baton.gate
            for release in unsent:
                self.book.retry_later(functools.partial(gate.release_many, [release]))
