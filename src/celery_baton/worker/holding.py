"""Holding: deliveries that wait in the consumer, costing no pool slot.

A delivery the gate refused for now waits here, in memory, in one FIFO per key (the
key that refused it; per fair key value with ``fair_key``: ``worker/wait_queues.py``).
Only the head of a queue asks the gate again, when its timer is due (the gate said
when: ``retry_after``) or at once when a lease on that key is released (a pub/sub
notice, relayed onto the consumer's own loop by ``worker/wake_pipe.py``).

Held deliveries raise the prefetch count like ETA tasks do, so they do not use up the
window the worker needs to receive work it can run; past ``baton_hold_max`` they keep
their slot, so the broker stops sending and memory stays bounded. Where the broker keeps
each consumer's prefetch fixed (RabbitMQ: quorum queues, every queue on RabbitMQ 4) the
raise does not reach it: a ``PrefetchWindow`` (``worker/transport/consumer_window.py``)
is told of each counted hold and opens the consumer again. A hold that refuses every
request alike (the store's grace, the store down) takes the broker's whole backlog that
way: when it ends, what is past the worker's window goes back (``worker/hold_end.py``).
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from celery_baton import metrics, signals
from celery_baton.core.conditions import ClaimUnique, NotDone, SlotNotRun, TakeLease
from celery_baton.core.debounce import FlowKind
from celery_baton.core.keys import words
from celery_baton.core.policy.model import RunPlan, TaskPolicy
from celery_baton.worker import pool_work
from celery_baton.worker.release_log import ReleaseLog
from celery_baton.worker.verdict import Reason, Wait
from celery_baton.worker.wait_queues import WaitQueues
from celery_baton.worker.wake_pipe import WakePipe

logger = logging.getLogger("celery_baton.worker")

BACKOFF_START = 0.25
#: How long a release is remembered: a denial may still be on its way back to the loop
#: while the release that follows it is already announced.
REMEMBER_RELEASES = 10.0


#: A lease waited for is asked again as it is released (its notice): the hold's delay
#: is only its latest moment, and the log says so.
_WOKEN_BY_RELEASE = frozenset({Reason.EXCLUSIVE, Reason.CONCURRENCY, Reason.RUNNING_COPY})
_AS_RELEASED = " at the latest, or as soon as it is released"


class PrefetchWindow(Protocol):
    """Told of each held message that raised the prefetch count, and of its leaving."""

    def held(self, message: Any) -> None: ...

    def left(self, message: Any) -> None: ...


class CountOnly:
    """The prefetch count alone keeps held messages out of the window."""

    def held(self, message: Any) -> None:
        pass

    def left(self, message: Any) -> None:
        pass


#: What the wake pipe carries for a cancel notice (never a store key: those have no
#: newline).
CANCEL_WAKE = "\ncancel"
#: ... and for release notices that may have been missed (the notice listener subscribed
#: again): every held queue asks again.
ALL_WAKE = "\nall"


@dataclass(eq=False)
class Delivery:
    """A delivered request the consumer is deciding about, or holding."""

    request: Any
    policy: TaskPolicy
    plan: RunPlan
    generation: int
    since: float = field(default_factory=time.monotonic)
    held: bool = False
    held_for: Reason | None = None  # why it waits now (worker/hold_end.py: store-wide?)
    counted: bool = False  # raised the prefetch count (False past baton_hold_max)
    backoff: float = BACKOFF_START  # the next wait when the store is down
    denied_since: float | None = None  # when an exclusive refusal was first seen
    asking: bool = False  # a gate call for it is in flight
    asked_at: float = 0.0  # when the last gate call for it was sent
    flow_asked_at: float = 0.0  # when its debounce/throttle decision was asked, if it ran
    queue_key: str | None = None  # the wait queue it sits in
    celery_rate: float | None = None  # Celery's rate_limit its plan was made with
    # Pool slots (worker/pool_slots.py): asked only while one is reserved for it.
    waiting_slot: bool = False  # waits for a pool process to come free
    slot: bool = False  # a pool slot is reserved for it
    reserved_start: bool = False  # granted a rate slot for later: keeps its pool slot
    start_due: float = 0.0  # when its grant was to start (a reserved slot: its instant)
    # Asked before its slot came (worker/asking_ahead.py): the grant in hand, its timer.
    ahead: Any = None
    ahead_timer: Any = None
    asked_ahead: bool = False  # once at most: a refusal is not asked again before its slot
    # A "skip" duplicate held for a release in flight (verdict.SKIP_GRACE): asked again
    # without waiting for a pool process, since its answer is most likely a skip, which
    # needs none (with the pool busy it asked only after its holder ended, and ran).
    skip_grace: bool = False
    # The key its last task-baton-held event named, and why (worker/events.py).
    announced: str | None = None
    announced_reason: str = ""
    # When its message's claim on the broker began: its delivery, or its last renewal
    # (worker/transport/held_renewal.py). The hold horizon counts from here.
    claimed_at: float = 0.0

    def __post_init__(self) -> None:
        self.claimed_at = self.claimed_at or self.since

    @property
    def at_start(self) -> bool:
        """Whether it is asked only once a pool process can start it now. A plan that
        asks nothing but the redelivery guard's (its own task id's run lease and done
        marker, or a beat slot's run record) limits no other work: granted while it
        waits for a process, it keeps out only copies of itself, which must wait anyway.
        It is asked at once, as before pool slots, and its round trip overlaps the runs
        ahead of it. So is a unique claim made where the call arrives (published where
        its options were unknown): it keeps out only the duplicates of the call. A
        throttle is a limit too (one start per window): its window opens when its run
        starts."""
        if self.policy.flow is not None and self.policy.flow.kind is FlowKind.THROTTLE:
            return True
        run_key = self.plan.run_key
        return any(
            not (
                isinstance(c, NotDone | SlotNotRun | ClaimUnique)
                or (isinstance(c, TakeLease) and c.key == run_key)
            )
            for c in self.plan.conditions
        )


class Holding:
    """Held deliveries, their timers, the prefetch count and the wake-ups.

    ``ask(delivery)`` is called (on the consumer's loop) when the head of a queue is
    due; its answer comes back through ``hold``/``release``.
    """

    def __init__(
        self,
        consumer: Any,
        *,
        ask: Callable[[Delivery], None],
        hold_max: int,
        horizon: float,
        stats: dict[str, int],
        rank: Callable[[Any], float | None] = lambda request: None,
        strict_rank: Callable[[Any], bool] = lambda request: False,
        on_held: Callable[[Delivery, Wait], None] = lambda delivery, wait: None,
        window: PrefetchWindow | None = None,
    ) -> None:
        self.consumer = consumer
        self.window: PrefetchWindow = window or CountOnly()
        self.ask = ask
        self.on_held = on_held  # every hold, also of one held already (its task event)
        self.stats = stats
        # A request's urgency (higher first; None: no priority), see WaitQueues.
        self.rank = rank
        self.hold_max = hold_max
        self.horizon = horizon
        self.lock = threading.RLock()
        self.counted = 0  # held deliveries that raised the prefetch count
        self._held: dict[int, Delivery] = {}  # by id(): what a lost connection leaves
        self._queues: WaitQueues[Delivery] = WaitQueues(rank, strict_rank)
        self._timers: dict[str, tuple[float, Any]] = {}
        self._wake_pipe = WakePipe(consumer, self._on_release)
        self._on_cancel: Callable[[], None] | None = None
        self._released = ReleaseLog()
        self._cap_warned = -1e9

    @property
    def held_count(self) -> int:
        return len(self._held)

    def held_deliveries(self) -> list[Delivery]:
        return list(self._held.values())

    def counted_messages(self) -> list[Any]:
        """The messages of the held deliveries that raised the prefetch count."""
        return [_message(d) for d in list(self._held.values()) if d.counted]

    # -- holding and letting go -------------------------------------------------------

    def hold(self, delivery: Delivery, wait: Wait) -> None:
        """Hold ``delivery`` in ``wait.key``'s queue and ask again after ``wait.delay``."""
        if not delivery.held:
            self._count(delivery)
            self.stats["held"] += 1
            metrics.holds.labels(delivery.request.name).inc()
            signals.task_held.send(
                sender=delivery.request.task,
                request=delivery.request,
                key=wait.key,
                retry_after=wait.delay,
            )
            logger.log(
                logging.DEBUG if wait.quiet else logging.INFO,
                "%s[%s] held for %s, retry in %.3fs"
                + (_AS_RELEASED if wait.reason in _WOKEN_BY_RELEASE else ""),
                delivery.request.name,
                delivery.request.id,
                _key_said(delivery, wait.key),
                wait.delay,
            )
        delivery.held_for = wait.reason
        self.on_held(delivery, wait)
        limit_key, queue_key = _queue_of(delivery, wait)
        if delivery.queue_key != queue_key:
            self.remove(delivery)
            self._queues.add(queue_key, limit_key, delivery)
            delivery.queue_key = queue_key
        delay = wait.delay
        if self._released.at(wait.key) >= delivery.asked_at:
            delay = 0.0  # released after we asked: the notice came before the denial
        self.arm(queue_key, delay, jitter=wait.jitter)

    def others_waiting(self, queue_key: str, delivery: Delivery) -> bool:
        """Whether ``queue_key``'s queue holds a delivery other than ``delivery``, not
        asking now (WaitQueues.others_waiting)."""
        return self._queues.others_waiting(queue_key, delivery)

    def hold_reserved(self, delivery: Delivery) -> None:
        """Count a delivery whose rate slot is reserved for later, in no queue."""
        self.remove(delivery)
        delivery.held_for = None
        if not delivery.held:
            self._count(delivery)

    def _count(self, delivery: Delivery) -> None:
        delivery.held = True
        self._held[id(delivery)] = delivery
        metrics.held_now.set(self.held_count)
        if self.counted < self.hold_max:
            # Like an ETA task: a held request must not use up the prefetch window, or
            # the worker would stop receiving the work it could run.
            delivery.counted = True
            self.counted += 1
            pool_work.raise_window(self.consumer.qos)
            self.window.held(_message(delivery))
        else:
            # Past the cap held requests keep their prefetch slot: the window fills and
            # the broker stops sending to this worker, so memory stays bounded (handing
            # them back would make Redis redeliver them at once, a spin).
            self._warn_cap()

    def release(self, delivery: Delivery) -> None:
        """``delivery`` leaves (it starts, is skipped or handed back)."""
        if delivery.queue_key is not None:
            self.remove(delivery)
        delivery.held_for = None
        if delivery.held:
            delivery.held = False
            self._held.pop(id(delivery), None)
            metrics.held_now.set(self.held_count)
            metrics.hold_seconds.labels(delivery.request.name).observe(
                time.monotonic() - delivery.since
            )
            if delivery.counted:
                delivery.counted = False
                self.counted -= 1
                pool_work.lower_window(self.consumer.qos)
                self.window.left(_message(delivery))

    def remove(self, delivery: Delivery) -> None:
        """Take ``delivery`` out of its queue (it stays counted)."""
        key, delivery.queue_key = delivery.queue_key, None
        if key is None:
            return
        queue = self._queues.get(key)
        if queue is None:
            return
        was_head = bool(queue) and queue[0] is delivery
        with contextlib.suppress(ValueError):
            queue.remove(delivery)
        if not queue:
            self._drop_queue(key)
        elif was_head:
            # The next one may pass now (a slot, a lease): ask on the next loop turn,
            # not recursively from inside this answer.
            self.consumer.timer.call_after(0, self._on_timer, (key,))

    def forget(self) -> list[Delivery]:
        """Drop every held delivery (the connection is gone: the broker redelivers);
        returns them."""
        with self.lock:
            forgotten, self._held = list(self._held.values()), {}
            self.counted = 0
            for _, entry in self._timers.values():
                entry.cancel()
            self._timers.clear()
            self._queues.clear()
            return forgotten

    def held_by_key(self, top: int = 20) -> dict[str, int]:
        with self.lock:
            sizes = sorted(self._queues.sizes(), reverse=True)
        return {key: size for size, key in sizes[:top]}

    def _warn_cap(self) -> None:
        now = time.monotonic()
        if now - self._cap_warned > 10:
            self._cap_warned = now
            logger.warning(
                "%d requests held, past baton_hold_max=%d: the rest keep their prefetch "
                "slots, so this worker receives no more messages until some leave",
                self.held_count,
                self.hold_max,
            )

    def spread(self, key: str) -> None:
        """Ask again now for what waits in ``key``'s queue (the store's, when it answers
        again), each fair request from its own key's fair queue: when the store is back,
        each key's head asks and the store picks among them. In the one queue they asked
        in arrival order, one at a time, a big backlog's first (issue 39). While the
        store is down they wait in one queue, so that one request probes it."""
        queue = self._queues.get(key)
        if not queue:
            return
        for delivery in [d for d in queue if d.plan.fair_queues and not d.asking]:
            queue.remove(delivery)
            limit_key, queue_key = _own_fair_queue(delivery.plan)
            self._queues.add(queue_key, limit_key, delivery)
            delivery.queue_key = queue_key
            self.arm(queue_key, 0.0, jitter=False)
        if queue:
            self.arm(key, 0.0, jitter=False)
        else:
            self._drop_queue(key)

    def wake_all(self) -> None:
        """Ask the head of every queue again now: the store answers again after a
        failure, and a release notice may have been lost meanwhile."""
        for _, key in self._queues.sizes():
            self.arm(key, 0.0)

    # -- timers -----------------------------------------------------------------------

    def arm(self, key: str, delay: float, *, jitter: bool = True) -> None:
        delay = min(delay, self.horizon)  # never sleep past the horizon
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
            with self.lock:
                self._timers.pop(key, None)
                self._drain(key)
        except Exception:
            logger.exception("baton: draining %s failed; retrying", key)
            with self.lock:
                self.arm(key, 1.0)

    def _drain(self, key: str) -> None:
        """Ask for the head of ``key``'s queue. Its answer re-arms the timer (it still
        waits), moves it to another queue, or lets it leave, which drains on."""
        queue = self._queues.get(key)
        if not queue:
            self._drop_queue(key)
            return
        head = queue[0]
        if not head.asking:
            self.ask(head)

    def _drop_queue(self, key: str) -> None:
        self._queues.drop(key)
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer[1].cancel()

    # -- wake-ups from the notice listener thread -----------------------------------

    def install_wakeup(self, consumer: Any) -> None:
        """Let another thread wake a key's queue on the consumer's own loop.

        Called at every consumer start: after a lost broker connection Celery resets
        the event loop, which drops every file descriptor registered on it."""
        self.consumer = consumer
        self._wake_pipe.install(consumer)

    def wake(self, key: str) -> None:
        """Called from another thread when ``key`` was released."""
        # Remembered even when nobody waits here yet: a denial may be on its way back
        # to this loop while the release that follows it is already announced.
        self._released.note(key)
        if self._queues.waiting_for(key):
            self._wake_pipe.send(key)

    def wake_for_cancel(self, on_loop: Callable[[], None]) -> None:
        """Called from another thread on a cancel notice: ``on_loop()`` runs on the
        consumer's loop (where held deliveries may be touched), when any is held."""
        self._on_cancel = on_loop
        if self._held:
            self._wake_pipe.send(CANCEL_WAKE)

    def notices_missed(self) -> None:
        """Called from another thread when release notices may have been missed (the
        notice listener lost its connection and subscribed again): a held request waiting
        for a release that happened meanwhile would wait for its timer, a whole lease
        away. Every held queue asks again, on the consumer's loop."""
        if self._held:
            self._wake_pipe.send(ALL_WAKE)

    def held(self) -> list[Delivery]:
        """The deliveries held now."""
        return list(self._held.values())

    def _on_release(self, key: str) -> None:
        """``key`` was released: its queue, and each fair queue of it, asks again."""
        if key == CANCEL_WAKE:
            if self._on_cancel is not None:
                self._on_cancel()
            return
        if key == ALL_WAKE:
            with self.lock:
                self.wake_all()
            return
        with self.lock:
            queues = self._queues.woken_by(key)
        for queue_key in queues:
            self._on_timer(queue_key)


def _queue_of(delivery: Delivery, wait: Wait) -> tuple[str, str]:
    """The limit key and the queue ``delivery`` waits in for ``wait``. A store's grace
    refuses every request on one key: a fair request waits for it in its own key's fair
    queue, so that when the grace ends each key's head asks and the store picks among
    them. In the grace's one queue they asked in arrival order, one at a time: a big
    backlog's first, each admitted while the cap had room (issue 39)."""
    fair_queues = delivery.plan.fair_queues
    if wait.reason is Reason.GRACE and fair_queues:
        return _own_fair_queue(delivery.plan)
    return wait.key, fair_queues.get(wait.key, wait.key)


def _own_fair_queue(plan: RunPlan) -> tuple[str, str]:
    """The limit key and the fair queue of a fair plan's first shared limit: where it
    waits for what refuses every key alike (a grace, a store that does not answer)."""
    return next(iter(plan.fair_queues.items()))


def _message(delivery: Delivery) -> Any:
    return getattr(delivery.request, "message", None)


def _key_said(delivery: Delivery, key: str) -> str:
    """``key`` for a log line, with its words as ``locks`` shows them when the plan
    labelled it (``baton:{proj.fetch}:rate:b8e1… (fetch(account=42))``): the digest
    alone named nothing an operator could find. No key: the store's grace (it lost or
    may lack its leases), not a holder."""
    if not key:
        return "the store's grace"
    label = delivery.plan.labels.get(key)
    return key if label is None else f"{key} ({words(key, label)})"
