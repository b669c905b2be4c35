"""Batching in the consumer: calls of a batched task wait here, their messages unacked,
costing no pool slot, until their key's batch ran (core/batch.py says where the state is).

A received call is held (counted like an ETA task, so the prefetch window keeps room for
work this worker can run) and registered in the store under its key at the next tick.
Every ``interval`` one tick per key (one round trip for all keys) renews this worker's
presence and the batch it runs, tells which held calls ran in a batch (their messages
are acked here, nothing runs), re-registers the calls the store forgot, and claims due
batches of which this worker holds a call, as many as it has free processes (none while
none is free). That call's own request carries the batch into the pool
(worker/pool/batch_run.py runs the body and writes every call's result). When the
carrier leaves the pool, the run ends: calls it did not mark done wait again.

A batch whose body returned is marked done again by its runner, at its end, and for one
run ttl after (after the store answers again, when it was away) at its full checks while
the key is in a grace: its pool process's done
marker may be lost (written on a Sentinel master just replaced by a replica it had not
reached; the key's promotion grace holds every claim meanwhile, core/batch.py), and its
calls must not run twice.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from celery.exceptions import TimeLimitExceeded
from celery.worker import state as worker_state

from celery_baton.core.batch import Batches, Call, KeyTick, delivery_id, fit_batch, task_id_of
from celery_baton.core.keys import task_words
from celery_baton.core.policy.model import TaskPolicy
from celery_baton.core.shared_limits import call_cost
from celery_baton.errors import BatonError, CostError, KeySpecError, StoreUnavailable
from celery_baton.worker import outcomes, pool_work
from celery_baton.worker.cancelling import Cancelling, revoke
from celery_baton.worker.holding import CountOnly, PrefetchWindow
from celery_baton.worker.pool.batch_run import (
    BATCH_FIELD,
    decode_call,
    encode_request_call,
    fail_the_others,
)
from celery_baton.worker.transport.acks_together import acknowledge_together

logger = logging.getLogger("celery_baton.worker")

#: Seconds between two ticks at most (a shorter batch_wait ticks faster).
INTERVAL_MAX = 0.05
INTERVAL_MIN = 0.01
#: Seconds between two ticks of a key with nothing new: how late a holder may hear that
#: its calls ran (their messages are acked then) when no batch of that key is due.
IDLE_TICK = 0.25
#: Seconds between two full checks of a key's held calls (the store may have forgotten
#: them; a holder may have died).
FULL_CHECK = 1.0


#: Set on a held call's kombu message: when it was received (monotonic seconds).
RECEIVED_ATTR = "_baton_batch_received"


def _mark_received(request: Any) -> None:
    message = getattr(request, "message", None)
    if message is not None and hasattr(message, "__dict__"):
        message.__dict__[RECEIVED_ATTR] = time.monotonic()


def _received_at(request: Any) -> float:
    """When a held call was received; long ago if unknown (the reconnect leaves it to
    the broker's visibility timeout, as before)."""
    message = getattr(request, "message", None)
    return float(getattr(message, "__dict__", {}).get(RECEIVED_ATTR, float("-inf")))


def tick_interval(waits: list[float]) -> float:
    """One tick every quarter of the shortest batch_wait, within [10 ms, 50 ms]: a lone
    call's batch starts at most about two ticks after its wait."""
    if not waits:
        return INTERVAL_MAX
    return max(INTERVAL_MIN, min(INTERVAL_MAX, min(waits) / 4))


@dataclass
class Running:
    """A batch this worker claimed and carries into its pool."""

    run: str
    carrier_id: str
    carrier: Any  # the Celery request
    call_ids: list[str]  # the batch's calls, written back if the store forgot the run
    ended: bool = False  # left the pool; the store not told yet
    completed: bool = False  # its body returned: the pool process marked the calls done
    # (or its hard time limit killed it: every call failed, written here)


@dataclass
class KeyState:
    """This worker's side of one batch key."""

    keys: list[str]
    size: int
    wait: float
    run_ttl: float  # the task's lease_ttl
    label: str  # the key in words, written for the operator with the key's ticks
    # A batch's cost of its named limits, when ``cost=`` is a callable (of the calls):
    # priced at the claim, before the run asks for it (None: a number, or no limits).
    price: Callable[[list[Call]], float] | None = None
    held: dict[str, Any] = field(default_factory=dict)  # call id -> request
    new: list[tuple[str, str]] = field(default_factory=list)  # to register
    gone: list[str] = field(default_factory=list)  # held no more: they leave the key
    running: list[Running] = field(default_factory=list)  # batches it carries now
    # Batches it ran to their end: (until when, monotonic; their call ids), marked done
    # again at full checks (the store may have lost the markers in a failover).
    ran: list[tuple[float, list[str]]] = field(default_factory=list)
    in_grace: bool = False  # the store's last tick of the key said it is in a grace
    next_full: float = 0.0
    next_tick: float = 0.0  # when it is ticked again without news (monotonic)


class Batching:
    """Holds the calls of batched tasks and runs their batches; see the module docstring."""

    def __init__(
        self,
        consumer: Any,
        batches: Batches,
        *,
        send: Callable[[Any], None],
        presence: float,
        keep: float,
        interval: float,
        hold_max: int = 10_000,
        cancelling: Cancelling | None = None,
        on_loop: Callable[[Callable[[], None]], None] | None = None,
        window: PrefetchWindow | None = None,
    ) -> None:
        self.consumer = consumer
        # Told of each held call that raised the prefetch count, as of a held request:
        # where RabbitMQ keeps a consumer's prefetch fixed, it opens the consumer again
        # (worker/transport/consumer_window.py); uncounted, a quorum queue's batches were
        # the window's size (8 of 10).
        self.window: PrefetchWindow = window or CountOnly()
        self.batches = batches
        self.send = send  # to the pool, as a plain request
        self.presence = presence  # how long the store believes this worker alive
        self.keep = keep  # how long a done call is remembered
        self.interval = interval
        # Past this many held calls, a held call keeps its prefetch slot: the window
        # fills and the broker stops sending, so memory stays bounded (baton_hold_max).
        self.hold_max = hold_max
        self.cancelling = cancelling  # baton.cancel: a held call cancelled never runs
        # Runs a call on the consumer's loop thread (worker/loop_door.py): a batch that
        # returned has the next one claimed at once, not at the next tick (None: not).
        self.on_loop = on_loop
        self._ticking = False
        self._counted: dict[int, Any] = {}  # by id(): the held requests that raised it
        # A restarted worker with the same name is a new holder: its predecessor's calls
        # are not its own.
        self.worker = f"{consumer.hostname}/{uuid.uuid4().hex[:8]}"
        self.keys: dict[str, KeyState] = {}
        self._timer: Any = None
        self._down_said = 0.0
        self._claim_turn = 0  # which key gets the first of the free processes (_claims)
        self.stats = {"batches": 0, "calls_acked": 0}

    # -- the consumer's side ----------------------------------------------------------

    def start(self, consumer: Any) -> None:
        """At every consumer start (a new loop after a lost connection)."""
        self.consumer = consumer
        if self._timer is not None:
            self._timer.cancel()
        self._timer = consumer.timer.call_repeatedly(self.interval, self.tick, priority=5)

    def forget(self) -> list[tuple[Any, float]]:
        """The connection is gone: the held calls' requests, each with when it was
        received (monotonic), for the reconnect to take back (held_return.py); the
        broker delivers the others again."""
        forgotten: list[tuple[Any, float]] = []
        for state in self.keys.values():
            forgotten += [(request, _received_at(request)) for request in state.held.values()]
            # Out of the key at the next tick, so that no batch waits for this worker
            # to carry them; their copies are registered again where they are delivered.
            state.gone.extend(state.held)
            state.held.clear()
            state.new.clear()
        self._counted.clear()  # the prefetch count starts anew with the connection
        return forgotten

    def receive(self, request: Any, policy: TaskPolicy) -> None:
        batch = policy.batch
        assert batch is not None
        try:
            # batch=True reads no argument: the call's body is not decoded for it.
            material = (
                ""
                if batch.key.whole_task
                else batch.material(request.name, request.args or (), request.kwargs or {})
            )
        except KeySpecError as exc:  # a publish without celery-baton: refused here
            outcomes.refuse(request, exc)
            return
        try:
            encoded = encode_request_call(request)
        except (TypeError, ValueError) as exc:
            outcomes.refuse(
                request, BatonError(f"a batched call's arguments must be JSON-serialisable: {exc}")
            )
            return
        keys = self.batches.keys(request.name, material)
        state = self.keys.get(keys[0])
        if state is None:
            label = task_words(request.name, material)
            state = self.keys[keys[0]] = KeyState(
                keys, batch.size, batch.wait, policy.lease_ttl, label, _pricer(policy)
            )
        call_id = delivery_id(request.id, int(request.request_dict.get("retries") or 0))
        if call_id in state.gone:  # held again (the reconnect took it back): not leaving
            state.gone.remove(call_id)
        if call_id in state.held:  # the same call twice: keep the newer copy
            self._drop_copy(state.held.pop(call_id), request)
        state.held[call_id] = request
        _mark_received(request)
        state.new.append((call_id, encoded))
        if len(self._counted) < self.hold_max:
            # Like an ETA task: a held call must not use up the prefetch window.
            self._counted[id(request)] = request
            pool_work.raise_window(self.consumer.qos)
            self.window.held(getattr(request, "message", None))

    # -- the tick ---------------------------------------------------------------------

    def tick(self) -> None:
        # On the consumer's loop; kombu's timer swallows exceptions: say them.
        if self._ticking:
            # A run ended within this tick (solo runs it here; a green pool's store call
            # lets another greenlet in): the next tick sees it.
            return
        self._ticking = True
        try:
            self._tick()
        except Exception:
            logger.exception("baton: a batching tick failed (retried at the next tick)")
        finally:
            self._ticking = False

    def _returned(self) -> None:
        """A batch's body returned: its process is free, so a tick now ends the run in
        the store and claims the next due batch (within a tick's interval otherwise: a
        process idle for up to 50 ms after every batch)."""
        if self.on_loop is not None:
            self.on_loop(self.tick)

    def _tick(self) -> None:
        self._end_runs()
        for state in self.keys.values():
            self._drop_cancelled(state)
        now = time.monotonic()
        for state in self.keys.values():
            if state.ran and state.ran[0][0] <= now:
                state.ran = [r for r in state.ran if r[0] > now]
        kept = [s for s in self.keys.values() if s.held or s.new or s.running or s.gone or s.ran]
        self.keys = {s.keys[0]: s for s in kept}
        # A key is ticked when it has news (calls to register, a run to renew), when its
        # batch may be due, or at least every IDLE_TICK (to hear of calls that ran).
        states = [
            s
            for s in kept
            if s.new or s.gone or s.running or now >= s.next_tick or now >= s.next_full
        ]
        if not states:
            return
        claims = self._claims(len(states))
        ticks = []
        for state, most in zip(states, claims, strict=True):
            held = None
            if now >= state.next_full:
                state.next_full = now + FULL_CHECK
                held = list(state.held)
            new, state.new = state.new, []
            gone, state.gone = state.gone, []
            live = [r for r in state.running if not r.ended]
            # At a full check, the runs' calls: written back if the store forgot a run.
            run_calls = (
                [(r.run, call_id) for r in live for call_id in r.call_ids]
                if held is not None
                else []
            )
            ticks.append(
                KeyTick(
                    state.keys,
                    state.size,
                    state.wait,
                    run_ttl=state.run_ttl,
                    runs=[r.run for r in live],
                    run_calls=run_calls,
                    gone=gone,
                    new=new,
                    held=held,
                    label=state.label,
                    done=(
                        [i for _, ids in state.ran for i in ids]
                        if held is not None and state.in_grace
                        else []
                    ),
                    keep=self.keep,
                    most=most,
                )
            )
        try:
            replies = self.batches.tick(self.worker, self.presence, ticks)
        except StoreUnavailable as exc:
            for state, sent in zip(states, ticks, strict=True):
                state.new[:0] = sent.new
                state.gone[:0] = sent.gone
                if sent.held is not None:
                    state.next_full = 0.0
            # The batches it ran are kept one run ttl past the store's return, not their
            # end: a master killed just after marking them done is replaced when its
            # failure is detected (a Cluster's node timeout, 15 s by default; Sentinel's
            # down-after), often later than that, and the promoted replica's grace is
            # when they are marked done again.
            for state in self.keys.values():
                state.ran = [(max(until, now + state.run_ttl), ids) for until, ids in state.ran]
            self._say_down(exc)
            return
        for state, reply in zip(states, replies, strict=True):
            if reply.promoted:
                logger.warning(
                    "baton: batch key %s: the store was promoted from a replica (a "
                    "failover) and may lack its old master's last writes; no batch is "
                    "claimed for %.1f s while runners write theirs back",
                    state.label,
                    reply.promoted,
                )
            if reply.redone:
                self._said_redone(state, reply.redone)
            if reply.grace and not state.in_grace:
                # Its runs written back and the batches it ran told at the next tick.
                state.next_full = 0.0
            state.in_grace = reply.grace > 0
            due = IDLE_TICK if reply.due is None else min(IDLE_TICK, reply.due)
            state.next_tick = now + due
            finished = [state.held.pop(call_id, None) for call_id in reply.finished]
            self._leave_acked([request for request in finished if request is not None])
            for call_id in reply.missing:
                request = state.held.get(call_id)
                if request is not None:
                    encoded = encode_request_call(request)
                    state.new.append((call_id, encoded))
            for claim in reply.claims:
                self._start(state, claim.run, claim.carrier, claim.calls)

    def _claims(self, keys: int) -> list[int]:
        """How many due batches each of ``keys`` keys ticked now may claim: the free
        processes shared among them, none beyond (the keys that get one turn about from
        tick to tick). A batch claimed for no free process waits, its calls claimed, while
        another worker holding calls of it may have one free; and on a green pool the
        carrier handed to a full pool blocks the consumer (gevent's and eventlet's
        ``spawn`` wait for a free greenlet): no tick renews this worker's runs meanwhile,
        and a run whose renewal lapsed is claimed again elsewhere while it waits to
        start (its calls ran twice)."""
        free = self._free_processes()
        if free <= 0:
            return [0] * keys
        each, left = divmod(free, keys)
        first = self._claim_turn % keys
        self._claim_turn += 1
        return [each + ((i - first) % keys < left) for i in range(keys)]

    def _free_processes(self) -> int:
        """The pool's processes (threads, greenlets) that run nothing now: those it has
        less the requests they accepted and the batches sent to it not accepted yet; at
        most what the pool itself says can start a job now, where it says so: a prefork
        pool (up, idle, not leaving after ``--max-tasks-per-child``: the formula counts a
        leaving process, and one the pool grows by, not up yet, as free), a green pool
        (its free greenlets: a job it spawned starts later, counted in the formula only
        once it starts)."""
        pool = getattr(self.consumer, "pool", None)
        size = int(getattr(pool, "num_processes", 0) or 0)
        active = worker_state.active_requests
        sent = sum(
            1
            for state in self.keys.values()
            for r in state.running
            if not r.ended and r.carrier is not None and r.carrier not in active
        )
        free = size - len(active) - sent
        inner = getattr(pool, "_pool", None)
        for says in ("startable", "free_count", "free"):  # prefork, gevent, eventlet
            count = getattr(inner, says, None)
            if callable(count):
                return min(free, int(count()))
        return free

    def _drop_cancelled(self, state: KeyState) -> None:
        """Held calls that ``baton.cancel`` cancelled (noticed by id, or by key): revoked
        as Celery revokes (REVOKED, acked), and taken out of the key at its next tick."""
        if self.cancelling is None or not state.held:
            return
        watch = self.cancelling.watch
        first = next(iter(state.held.values()))
        if not (watch.ids_live() or watch.has_key_cancels(first.name)):
            return  # no cancel could name them: nothing to look up
        for call_id, request in list(state.held.items()):
            why = self.cancelling.known(request)
            if why is None:
                continue
            del state.held[call_id]
            self._leave(request, ack=False)
            revoke(request, why)
            state.gone.append(call_id)

    def _noticed(self, call_id: str) -> bool:
        return self.cancelling is not None and self.cancelling.watch.noticed(task_id_of(call_id))

    def _start(self, state: KeyState, run: str, carrier_id: str, calls: list[Any]) -> None:
        request = state.held.pop(carrier_id, None)
        if request is None:  # not held any more (acked meanwhile): nothing carries it
            state.running.append(Running(run, carrier_id, None, [], ended=True))
            return
        self._leave(request, ack=False)
        why = self.cancelling.known(request) if self.cancelling is not None else None
        if why is not None:  # cancelled: it carries nothing; the others wait again
            revoke(request, why)
            state.running.append(Running(run, carrier_id, None, [], ended=True))
            return
        # A call cancelled by id is left out of the run (marked done with it: its holder
        # revoked it).
        cancelled = [call_id for call_id, _ in calls if self._noticed(call_id)]
        kept = [call for call in calls if call[0] not in cancelled]
        cost = None
        if state.price is not None:
            try:
                kept, cost = _fit(kept, carrier_id, state.price)
            except CostError as exc:
                # The carrier alone costs more than a limit ever admits: it fails as a
                # plain call of that cost would; the others wait again (the run's end).
                outcomes.refuse(request, exc)
                state.running.append(Running(run, carrier_id, None, [], ended=True))
                return
        # The calls left out to fit the limits are not in ``done``: given back to the
        # key when the run ends (batch_done.lua).
        done = [call_id for call_id, _ in kept] + cancelled
        request.request_dict[BATCH_FIELD] = {
            "run": run,
            "keys": state.keys,
            "calls": [list(call) for call in kept],
            "done": done,
            "keep": self.keep,
            "cost": cost,  # of its named limits, priced here (None: the task's cost=)
        }
        running = Running(run, carrier_id, request, done)
        state.running.append(running)
        _watch_completion(request, running, self._returned)
        self.stats["batches"] += 1
        self._event(
            request,
            "task-baton-batch",
            run=run,
            calls=[task_id_of(call_id) for call_id, _ in calls],
        )
        logger.debug("%s: batch %s of %d calls starts", request.name, run, len(calls))
        self.send(request)

    def _end_runs(self) -> None:
        """Runs whose carrier left the pool: the store hears their end."""
        for state in self.keys.values():
            for running in list(state.running):
                if not running.ended and running.carrier in worker_state.reserved_requests:
                    continue
                running.ended = True
                done = running.call_ids if running.completed else []
                try:
                    redone = self.batches.end(
                        state.keys, running.run, running.carrier_id, done, self.keep
                    )
                except StoreUnavailable as exc:
                    self._say_down(exc)
                    return  # told at a later tick; the run's lease is no longer renewed
                state.running.remove(running)
                if done:
                    state.ran.append((time.monotonic() + state.run_ttl, done))
                if redone:
                    self._said_redone(state, redone)

    def _drop_copy(self, older: Any, newer: Any) -> None:
        """A held call received again. The Redis broker gives the same message again once
        its visibility timeout passed: both copies carry one delivery tag, and acking the
        older would take away the broker's unacked record of the newer (a holder killed
        then left nothing to give again: the call was lost). So the older copy is only
        forgotten; another message of the same call (a second publish) is acked."""
        if _delivery_tag(older) is not None and _delivery_tag(older) == _delivery_tag(newer):
            self._leave(older, ack=False)
            worker_state.task_ready(older)
            return
        self._leave(older, ack=True)

    def _leave(self, request: Any, *, ack: bool) -> None:
        if ack:
            self._leave_acked([request])
        elif id(request) in self._counted:
            self._uncount(request)

    def _uncount(self, request: Any) -> None:
        del self._counted[id(request)]
        pool_work.lower_window(self.consumer.qos)
        self.window.left(getattr(request, "message", None))

    def counted_messages(self) -> list[Any]:
        """The messages of the held calls that raised the prefetch count."""
        return [getattr(r, "message", None) for r in list(self._counted.values())]

    def _leave_acked(self, requests: list[Any]) -> None:
        """Held calls that ran in a batch (their results are written): acked, together
        (one broker round trip for a batch's calls: worker/transport/acks_together.py),
        nothing runs."""
        for request in requests:
            if id(request) in self._counted:
                self._uncount(request)
            self.stats["calls_acked"] += 1
            worker_state.task_ready(request)
        acknowledge_together(requests)
        for request in requests:
            self._event(request, "task-baton-batched")

    def _event(self, request: Any, kind: str, **fields: Any) -> None:
        """A task event, when the worker and the task send them (worker/events.py):
        ``task-baton-batch`` on the call whose request carries a batch (its ``run`` and
        ``calls``, the call ids), ``task-baton-batched`` on a held call that ran in a
        batch (its result is in the backend; Flower shows it ``BATON-BATCHED``)."""
        dispatcher = getattr(self.consumer, "event_dispatcher", None)
        if dispatcher is None or not dispatcher.enabled or not request.task.send_events:
            return
        if dispatcher.groups and "task" not in dispatcher.groups:
            return
        dispatcher.send(kind, uuid=request.id, **fields)

    def _said_redone(self, state: KeyState, count: int) -> None:
        logger.warning(
            "baton: batch key %s: %d calls of batches this worker ran had lost their done "
            "marker in the store (written on a master since replaced): marked done again",
            state.label,
            count,
        )

    def _say_down(self, exc: BaseException) -> None:
        now = time.monotonic()
        if now - self._down_said > 10:
            self._down_said = now
            logger.warning("baton: batched calls held while the store is unavailable: %s", exc)

    def held_count(self) -> int:
        # Also read by the autoscaler, on its own thread where there is no event loop:
        # the copy of the values is made at once, under the GIL.
        return sum(len(state.held) for state in list(self.keys.values()))


def _pricer(policy: TaskPolicy) -> Callable[[list[Call]], float] | None:
    """A batch's cost of ``policy``'s named limits when its ``cost=`` is a callable: it
    gets the batch's calls (core/batch.check_batch_cost); CostError past a limit's burst."""
    cost, shared = policy.cost, policy.shared
    if not shared or not callable(cost):
        return None
    return lambda calls: call_cost(cost, shared, (calls,), {})


def _fit(
    calls: list[tuple[str, str]], carrier: str, price: Callable[[list[Call]], float]
) -> tuple[list[tuple[str, str]], float]:
    """The claimed calls one admission can take (core/batch.fit_batch), and their cost."""
    decoded = [decode_call(call_id, encoded)[0] for call_id, encoded in calls]
    at = next((i for i, (call_id, _) in enumerate(calls) if call_id == carrier), 0)
    kept, cost = fit_batch(list(range(len(calls))), at, lambda ix: price([decoded[i] for i in ix]))
    return [calls[i] for i in kept], cost


def _delivery_tag(request: Any) -> Any:
    """The broker's tag of a request's message (None when it has none)."""
    return getattr(getattr(request, "message", None), "delivery_tag", None)


def _watch_completion(request: Any, running: Running, returned: Callable[[], None]) -> None:
    """``running.completed`` once the carrier's body returned (Celery hands the pool's
    outcome to ``request.on_success``; ``failed`` is false only when the task function
    returned, and the batch runner returns only after marking its calls done). Read at
    call time, the class's own ``on_success`` (the worker may swap the request's class).
    Then ``returned()``, once Celery's own handling (which took the carrier out of the
    reserved requests: the run has ended) is done."""

    def on_success(failed__retval__runtime: Any, **kwargs: Any) -> Any:
        outcome = failed__retval__runtime
        if isinstance(outcome, tuple) and outcome and not outcome[0]:
            running.completed = True
        try:
            return type(request).on_success(request, failed__retval__runtime, **kwargs)
        finally:
            returned()

    request.on_success = on_success

    def on_timeout(soft: bool, timeout: float) -> Any:
        # Past the hard limit Celery fails the carrier (here, in the main process) and
        # kills its process or greenlet: the batch ran, so every call fails so, as the
        # carrier does. Given back, they would run again, each run killed in turn. The
        # others first: Celery's own handling takes the carrier out of the reserved
        # requests, and on a green pool its write lets a tick end the run meanwhile. In a
        # cold shutdown Celery writes nothing: the calls wait again, their messages unacked.
        fails = not soft and not running.completed and not worker_state.should_terminate
        if fails:
            try:
                batch = request.request_dict[BATCH_FIELD]
                fail_the_others(request.task, request, batch, TimeLimitExceeded(timeout))
            finally:
                running.completed = True
        try:
            return type(request).on_timeout(request, soft, timeout)
        finally:
            if fails:
                returned()

    request.on_timeout = on_timeout
