"""Admission in the worker's consumer, before the pool.

``Admission`` replaces the consumer's ``on_task_request``: every delivered request
(plain, after its ETA, after Celery's own rate-limit bucket) reaches it before the
pool. A request of a task with a policy (``worker/planning.py`` says which, and what it
asks for) asks the gate once, and the verdict
(``worker/verdict.py``) says what it does:

* **Start**: it goes to the pool holding its leases (``worker/starting.py``; given
  back by ``worker/request.py`` through ``worker/releasing.py`` when it ends);
* **Skip**: acked, not run, logged, signalled, and recorded as a ``TaskSkipped`` result
  (an exclusive duplicate with ``exclusive_conflict="skip"``, or a task id that already
  finished under the redelivery guard), or as ``REVOKED`` with ``TaskSuperseded`` (a
  newer publish of the same key replaces it);
* **Wait**: held in the consumer (``worker/holding.py``), occupying no pool slot, and
  asked again when the gate said it may pass or when the key is released. A
  ``"replace"`` delivery first has the run it waits for terminated (a revoke broadcast). At the
  hold horizon its message's claim on a Redis broker is renewed
  (``worker/transport/held_renewal.py``); elsewhere it is handed back to the broker
  unchanged (``reject(requeue=True)``: same id, headers and retry count; never
  ``task.retry``).

When the store does not answer, ``worker/store_down.py`` says what the request does
(``baton_on_store_error``: held with back-off, or run unguarded); when it answers again,
or its grace ends, the held backlog past the worker's prefetch window goes back to the
broker (``worker/hold_end.py``). Each decision is also
a Celery task event when the worker sends them (``worker/events.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

from celery_baton.config import Settings
from celery_baton.core import fairness
from celery_baton.core.conditions import NotCancelled
from celery_baton.core.gate import Decision
from celery_baton.core.gate_channel import GateChannel
from celery_baton.core.keys import KeyNames
from celery_baton.core.leases import LeaseBook
from celery_baton.core.policy.headers import published_unaware
from celery_baton.core.policy.model import TaskPolicy
from celery_baton.errors import CostError, KeySpecError, StoreUnavailable
from celery_baton.worker import flow, misfire, ordering, outcomes
from celery_baton.worker.asking_ahead import AskingAhead
from celery_baton.worker.batching import Batching
from celery_baton.worker.cancelling import HELD_FOR_LATER_ATTR, Cancelling
from celery_baton.worker.events import DecisionEvents
from celery_baton.worker.hold_end import HoldEnd
from celery_baton.worker.holding import Delivery, Holding, PrefetchWindow
from celery_baton.worker.planning import Planner
from celery_baton.worker.pool.batch_run import BATCH_FIELD
from celery_baton.worker.pool.run_end import mark as mark_run_end
from celery_baton.worker.pool_slots import pool_slots
from celery_baton.worker.releasing import Releasing
from celery_baton.worker.replacing import Replacing, keep_order
from celery_baton.worker.request import attach
from celery_baton.worker.starting import Starting
from celery_baton.worker.store_down import BACKOFF_MAX, STORE_KEY, StoreDown
from celery_baton.worker.verdict import Reason, Skip, Start, Wait, verdict

logger = logging.getLogger("celery_baton.worker")


class Admission:
    """The consumer's ``on_task_request``; see the module docstring."""

    def __init__(
        self,
        consumer: Any,
        handle: Callable[[Any], Any],
        *,
        policy_for: Callable[[Any], TaskPolicy | None],
        names: KeyNames,
        channel: GateChannel,
        book: LeaseBook,
        releasing: Releasing,
        settings: Settings,
        horizon: float,
        lower_priority_first: bool = False,
        window: PrefetchWindow | None = None,
        renew: Callable[[list[Delivery]], list[Delivery]] | None = None,
        cancelling: Cancelling | None = None,
        batching: Batching | None = None,
    ) -> None:
        self.consumer = consumer
        self.batching = batching
        self.names = names
        self.cancelling = cancelling
        self.planner = Planner(
            policy_for=policy_for, names=names, settings=settings, hostname=consumer.hostname
        )
        self.channel = channel
        self.book = book
        self.releasing = releasing
        self.settings = settings
        self.on_store_error = settings.on_store_error
        self.horizon = horizon
        # Renews held messages' claims on the broker at the horizon (kombu's Redis
        # transport); returns those it could not renew. None: handed back there.
        self.renew = renew
        self._renewal: Any = None  # the timer entry of the renewal sweep
        self.stats = {"admitted": 0, "held": 0, "skipped": 0, "handed_back": 0, "throttled": 0}
        self.events = DecisionEvents(consumer, names)
        self.holding = Holding(
            consumer,
            ask=self._ask,
            hold_max=settings.hold_max,
            horizon=horizon,
            stats=self.stats,
            rank=functools.partial(_rank, lower_first=lower_priority_first),
            strict_rank=ordering.is_ordered,
            on_held=self.events.held,
            window=window,
        )
        self.generation = 0  # bumped when held requests are forgotten (connection lost)
        # A delivery asks only while a pool process can start it now (issue 24 §1).
        self.slots = pool_slots(consumer, handle)
        self.starting = Starting(
            consumer,
            self.slots,
            holding=self.holding,
            releasing=releasing,
            book=book,
            stats=self.stats,
            events=self.events,
        )
        if cancelling is not None:
            self.starting.cancelled = cancelling.known
            self.starting.drop_cancelled = self._drop_cancelled
        # The end of a store-wide hold hands back what this worker cannot start soon.
        self.hold_end = HoldEnd(
            self.holding,
            hand_back=functools.partial(self._hand_back, one_of_many=True),
            ask=self._ask,
            generation=lambda: self.generation,
        )
        self.store_down = StoreDown(
            on_store_error=settings.on_store_error,
            holding=self.holding,
            releasing=releasing,
            new_owner=self.planner.new_owner,
            run_unguarded=lambda delivery: self.starting.start(delivery, Start(), guarded=False),
            on_back=lambda: self.hold_end.ended(Reason.STORE_DOWN, "the store answers again"),
        )
        self.replacing = Replacing()
        self.ahead = AskingAhead()
        self._acquiring: Delivery | None = None  # asking for a slot now (found free?)
        self._unclaimed_said: set[str] = set()  # unique tasks published unclaimed, told

    # -- entry point ----------------------------------------------------------------

    def __call__(self, request: Any) -> Any:
        if self.cancelling is not None:
            why = self.cancelling.known(request)  # in memory: noticed ids, key cancels
            if why is not None:
                self.cancelling.revoke(request, why)
                return None
            if HELD_FOR_LATER_ATTR in request.__dict__:  # a unique task's countdown or ETA
                return self.cancelling.start_held(request, self._admit)
        return self._admit(request)

    def _plain(self, request: Any) -> Any:
        """A request that asks the gate nothing goes to Celery, once screened for a
        cancel by id (a store check only while cancels by id live)."""
        if self.cancelling is None:
            return self.slots.plain(request)
        return self.cancelling.screen(request, self.slots.plain)

    def _admit(self, request: Any) -> Any:
        policy = self.planner.policy(request)
        if policy is None:
            return self._plain(request)
        if policy.unique is not None and published_unaware(request.request_dict):
            self._say_unclaimed(request, policy)
        if policy.batch is not None and self.batching is not None:
            # Held until its key's batch ran (worker/batching.py); asks no gate.
            self.batching.receive(request, policy)
            return None
        return self._guard(request, policy)

    def _say_unclaimed(self, request: Any, policy: TaskPolicy) -> None:
        """Once per task: a unique task published where its options are unknown was not
        claimed at its publish; it is claimed as it arrives here (core/policy/plan.py),
        so its duplicates are queued, and those that arrive while it holds its key are
        not run. A ``"replace"`` call cannot be ordered here: it is not deduplicated."""
        if request.name in self._unclaimed_said:
            return
        self._unclaimed_said.add(request.name)
        if policy.unique_conflict == "replace":
            cost = "its unique key was not claimed, so its duplicates are queued and run"
        else:
            cost = (
                "its unique key was not claimed at the publish, so its duplicates are "
                "queued; it is claimed as the call reaches a worker, and a duplicate that "
                "arrives while another call holds the key is not run"
            )
        logger.warning(
            "%s[%s] was published by a process that does not know its options (sent by "
            "name from an app without the task, or by a publisher without celery-baton): "
            "%s; register the task (or a stub declaring the same options) in the "
            "publishing app (said once per task)",
            request.name,
            request.id,
            cost,
        )

    def carry(self, request: Any) -> None:
        """A batch's carrier (``worker/batching.py``), its batch claimed: the run is one
        start of the task's rate, one slot of its concurrency and one admission of each
        named limit, asked for here as any guarded request's; a batched task with none
        goes to the pool at once."""
        policy = self.planner.policy(request)
        if policy is None or not policy.gates_runs:
            self.slots.plain(request)
            return
        cost = (request.request_dict.get(BATCH_FIELD) or {}).get("cost")
        if cost is not None:
            # Priced on the batch's calls at its claim: the run spends that, not what a
            # callable would say of the carrier's own arguments.
            policy = dataclasses.replace(policy, cost=cost)
        self._guard(request, policy)

    def _guard(self, request: Any, policy: TaskPolicy) -> Any:
        """A guarded request, planned and asked for (or refused, or passed on plain)."""
        celery_rate = None
        if policy.rate_from_celery:
            celery_rate = self.planner.celery_rate(request.task)
            if celery_rate is None and policy.celery_rate_only:
                return self._plain(request)  # no rate_limit now: nothing to ask
        try:
            plan = self.planner.plan(policy, request, celery_rate)
        except (KeySpecError, CostError) as exc:
            self.events.refused(request, str(exc))
            outcomes.refuse(request, exc)
            return None
        if not plan.conditions and plan.flow_key is None:  # only a unique key to free
            attach(request, self.releasing, policy, plan)
            mark_run_end(request.request_dict, policy, plan)  # freed before the result
            return self._plain(request)
        with self.holding.lock:
            self._ask(Delivery(request, policy, plan, self.generation, celery_rate=celery_rate))
        return None

    # -- one decision ---------------------------------------------------------------

    def _ask(self, delivery: Delivery) -> None:
        """Ask the gate for ``delivery`` once a pool process can start it now: a token
        spent or a lease granted while the request waits behind other work would be
        judged at the wrong moment (worker/pool_slots.py)."""
        if delivery.slot or not delivery.at_start or delivery.skip_grace:
            self._decide(delivery)
        elif not delivery.waiting_slot:
            delivery.waiting_slot = True
            self.ahead.waiting.append(delivery)
            self._acquiring = delivery
            try:
                self.slots.acquire(functools.partial(self._slot_free, delivery))
            finally:
                self._acquiring = None
            self._ask_ahead()

    def _slot_free(self, delivery: Delivery) -> None:
        # Called on the loop (or the timer) when a slot is reserved for ``delivery``;
        # kombu swallows exceptions there, so none may escape: never lose a request.
        try:
            with self.holding.lock:
                delivery.waiting_slot = False
                delivery.slot = True
                if self._acquiring is not delivery:  # a slot came free (not found free)
                    self.ahead.slot_came(time.monotonic())
                self.ahead.prune(self.generation)
                try:
                    if delivery.asking:
                        return  # asked ahead, the answer on its way: it is used on arrival
                    granted = self._take_ahead(delivery)
                    if delivery.generation != self.generation:
                        # Forgotten meanwhile (the connection was lost): it goes.
                        if granted is not None:
                            self.releasing.give_back(delivery.plan)
                    elif granted is not None:
                        self._apply(delivery, granted)
                    else:
                        self._decide(delivery)
                finally:
                    self._settle_slot(delivery)
                    self._ask_ahead()
        except Exception:
            self._hold_after_error(delivery)

    # -- asking ahead (worker/asking_ahead.py) --------------------------------------

    def _ask_ahead(self) -> None:
        """Ask for the first delivery waiting for a slot now, while the pool drains short
        tasks: its grant is in hand when the slot comes (within the bound)."""
        now = time.monotonic()
        if not self.ahead.draining(now) or self.store_down.failed_moments_ago(now):
            return
        if self.cancelling is not None and self.cancelling.watch.ids_live():
            return  # a cancel by id is checked in the ask made at the slot (_decide)
        delivery = self.ahead.candidate(self.generation)
        if delivery is None:
            return
        if self.cancelling is not None and self.cancelling.known(delivery.request):
            return  # cancelled: it is revoked at its slot, never asked for
        self.ahead.current = delivery
        delivery.asked_ahead = True
        delivery.asking = True
        delivery.asked_at = now
        self.channel.ask(
            delivery.plan.conditions,
            owner=delivery.plan.owner,
            ttl=delivery.policy.lease_ttl,
            reserve=0.0,
            answer=functools.partial(self._answered_ahead, delivery),
        )

    def _answered_ahead(self, delivery: Delivery, reply: Decision | BaseException) -> None:
        # On the loop when the store answered an ask made ahead; nothing may escape.
        try:
            with self.holding.lock:
                self.ahead.done_with(delivery)
                if delivery.slot:  # the slot came first: an ask made on it, answered
                    self._answered(delivery, reply)
                    self._ask_ahead()
                    return
                delivery.asking = False
                if isinstance(reply, StoreUnavailable):
                    self.store_down.lost(delivery)  # it may still grant: given back later
                    return
                if isinstance(reply, Decision):
                    self.store_down.answered(delivery)
                granted = isinstance(reply, Decision) and reply.granted
                if (
                    not granted
                    or delivery.generation != self.generation
                    or not isinstance(reply, Decision)
                ):
                    if granted:
                        self.releasing.give_back(delivery.plan)
                    return  # refused (or failed): asked again when its slot comes
                left = self.ahead.bound - (time.monotonic() - delivery.asked_at)
                self.ahead.current = delivery
                delivery.ahead = reply
                delivery.ahead_timer = self.consumer.timer.call_after(
                    max(left, 0.0), self._ahead_expired, (delivery,), priority=5
                )
        except Exception:
            logger.exception(
                "baton: an ask ahead for %s[%s] failed", delivery.request.name, delivery.request.id
            )

    def _take_ahead(self, delivery: Delivery) -> Decision | None:
        """The grant ``delivery`` was asked ahead, if still within the bound (past it:
        given back, and None: it asks again)."""
        granted: Decision | None = delivery.ahead
        if granted is None:
            return None
        delivery.ahead = None
        self.ahead.done_with(delivery)
        timer, delivery.ahead_timer = delivery.ahead_timer, None
        if timer is not None:
            timer.cancel()
        now = time.monotonic()
        # Held before: revoked meanwhile, or past the horizon (_decide says what then).
        stale_hold = delivery.held and (
            delivery.request.revoked() or now - delivery.since >= self.horizon
        )
        cancelled = self.cancelling is not None and self.cancelling.known(delivery.request)
        if now - delivery.asked_at > self.ahead.bound or stale_hold or cancelled:
            self._give_back_ahead(delivery)
            return None
        return granted

    def _give_back_ahead(self, delivery: Delivery) -> None:
        """Give back a grant asked ahead that will not be used; the delivery's next ask
        is made as a new owner. A release compares only the owner, and it may reach the
        store after that next ask (a Cluster's or a pool thread's releases go out from a
        background thread, asks at once; a failed release is sent again later): under
        the same owner it would free the new grant while its run goes on."""
        self.releasing.give_back(delivery.plan)
        delivery.plan = delivery.plan.with_owner(self.planner.new_owner(delivery.request))

    def _ahead_expired(self, delivery: Delivery) -> None:
        # The timer: no slot within the bound; the grant goes back. Nothing may escape.
        try:
            with self.holding.lock:
                delivery.ahead_timer = None
                if delivery.ahead is None:
                    return
                delivery.ahead = None
                self.ahead.done_with(delivery)
                self._give_back_ahead(delivery)
        except Exception:
            logger.exception(
                "baton: giving back %s[%s]'s grant failed",
                delivery.request.name,
                delivery.request.id,
            )

    def _hold_after_error(self, delivery: Delivery) -> None:
        """A decision that raised: hold the delivery (asked again later), never lose it."""
        logger.exception(
            "baton: deciding %s[%s] failed; holding it",
            delivery.request.name,
            delivery.request.id,
        )
        with self.holding.lock:
            self.holding.hold(delivery, Wait(Reason.STORE_DOWN, STORE_KEY, BACKOFF_MAX))

    def _settle_slot(self, delivery: Delivery) -> None:
        """Give back the pool slot of a delivery that will not start on it now (held,
        skipped, handed back, forgotten); kept while its ask is in flight or its
        reserved rate slot is due."""
        if delivery.slot and not delivery.asking and not delivery.reserved_start:
            delivery.slot = False
            self.slots.give_back()

    def _decide(self, delivery: Delivery) -> None:
        """Ask the gate for ``delivery``, which holds a pool slot. The answer may come
        later (the channel is pipelined on the event loop): a delivery is never asked
        twice at once."""
        request = delivery.request
        if delivery.held and request.revoked():  # revoked or expired while held: Celery acks it
            self._unrun(delivery)
            return
        if self.cancelling is not None:
            why = self.cancelling.known(request) if delivery.held else None
            if why is not None:  # cancelled while held (this worker was told)
                self._unrun(delivery)
                self.cancelling.revoke(request, why)
                return
            if not self.cancelling.in_gate and self.cancelling.watch.ids_live():
                # Redis Cluster: the id's record is not on the task's slot, so it is
                # checked in a call of its own (one server: in the gate's, NotCancelled).
                self._unless_cancelled(delivery, functools.partial(self._decide_now, delivery))
                return
        self._decide_now(delivery)

    def _decide_now(self, delivery: Delivery) -> None:
        now = time.monotonic()
        if (
            delivery.held
            and now - delivery.claimed_at >= self.horizon
            and (self.renew is None or self.renew([delivery]))
        ):
            self._hand_back(delivery, f"held {now - delivery.since:.0f}s, the horizon")
            return
        if not delivery.held and self.store_down.failed_moments_ago(now):
            # The store failed moments ago: do not wait on it again for every new
            # request; queue behind the request that is probing it.
            self._answered(delivery, StoreUnavailable("the store failed moments ago"))
            return
        if (
            delivery.policy.rate_from_celery
            and self.planner.replan(delivery)  # Celery's rate_limit changed while held
            and not delivery.plan.conditions  # lifted: nothing left to ask the gate
            and (delivery.plan.flow_passed or delivery.plan.flow_key is None)
        ):
            self.starting.start(delivery, Start())
            return
        delivery.asking = True
        delivery.asked_at = now
        if delivery.plan.flow_key is not None and not delivery.plan.flow_passed:
            flow.ask(self.channel, self.names, delivery, self._answered)
            return
        conditions = delivery.plan.conditions
        if delivery.plan.fair_limits:  # fair_key: say whether more of its key wait here
            conditions = fairness.with_more(conditions, self._more_here(delivery))
        if self.cancelling is not None and self.cancelling.in_gate:
            # While cancels by id live, the gate call itself says whether this id is one.
            conditions = self.cancelling.with_check(delivery.request, conditions)
        logger.debug(
            "%s[%s] asks the gate (%s)",
            delivery.request.name,
            delivery.request.id,
            " ".join(type(c).__name__ for c in conditions),
        )
        self.channel.ask(
            conditions,
            owner=delivery.plan.owner,
            ttl=delivery.policy.lease_ttl,
            reserve=delivery.plan.reserve,
            answer=functools.partial(self._answered, delivery),
        )

    def _answered(
        self, delivery: Delivery, reply: Decision | flow.FlowDecision | BaseException
    ) -> None:
        # Runs on the event loop when the store answered; kombu swallows exceptions
        # there, so none may escape: a request must never be lost.
        try:
            with self.holding.lock:
                sent, delivery.asking = delivery.asking, False
                if sent and isinstance(reply, StoreUnavailable):
                    self.store_down.lost(delivery)
                if delivery.generation != self.generation:
                    # Dropped meanwhile (the broker connection was lost; its message
                    # goes to another worker): give back whatever the gate granted.
                    if isinstance(reply, Decision) and reply.granted:
                        self.releasing.give_back(delivery.plan)
                    return
                if isinstance(reply, BaseException):
                    self.store_down.failed(delivery, reply)
                    return
                self.store_down.answered(delivery)
                if isinstance(reply, flow.FlowDecision):
                    self._apply_flow(delivery, reply)
                else:
                    self._apply(delivery, reply)
        except Exception:
            self._hold_after_error(delivery)
        finally:
            with self.holding.lock:
                self._settle_slot(delivery)

    def _apply(self, delivery: Delivery, decision: Decision) -> None:
        request = delivery.request
        if isinstance(decision.denied_by, NotCancelled):  # baton.cancel: never runs
            assert self.cancelling is not None
            self._unrun(delivery)
            self.cancelling.revoke(request, "cancelled by id")
            return
        now = time.monotonic()
        delivery.skip_grace = False  # set again below for a skip grace's wait only
        held_for_grace = delivery.held_for is Reason.GRACE
        if decision.seq and delivery.plan.supersede_key:
            keep_order(request, delivery.plan, decision.seq)
        if decision.note:
            ordering.follow_note(request, delivery.plan, decision)
        outcome = verdict(
            decision,
            delivery.plan,
            task_name=request.name,
            task_id=request.id,
            conflict=delivery.policy.exclusive_conflict,
            denied_since=delivery.denied_since,
            now=now,
            wait_timeout=delivery.policy.exclusive_wait_timeout,
        )
        if held_for_grace and not (isinstance(outcome, Wait) and outcome.reason is Reason.GRACE):
            # The grace ended: the backlog it held here is every worker's again.
            self.hold_end.ended(Reason.GRACE, "the store's grace ended")
        if isinstance(outcome, Start):
            late = misfire.follow(  # a held beat slot
                delivery,
                decision,
                self.releasing,
                prefix=self.names.prefix,
                history=self.settings.beat_history,
            )
            if late is not None:
                self._skip(delivery, late)
            else:
                self.starting.start(delivery, outcome)
        elif isinstance(outcome, Skip):
            self._skip(delivery, outcome)
        else:
            if outcome.reason is Reason.EXCLUSIVE and delivery.denied_since is None:
                delivery.denied_since = now
            if outcome.reason is Reason.GRACE:
                self.store_down.warn_grace(outcome.delay, now)
            if outcome.revoke:
                self.replacing.terminate(request, outcome.revoke, delivery.plan, now)
            if outcome.reason is Reason.RATE:
                self.stats["throttled"] += 1
                outcomes.throttle(request, outcome.key, decision.retry_after)
            newer = outcome.reason is Reason.EXCLUSIVE and not delivery.held
            delivery.skip_grace = outcome.quiet
            self.holding.hold(delivery, outcome)
            if newer and delivery.plan.supersede_key:
                # A newer publish waits now: the older ones held here are superseded;
                # ask them at once, so their callers learn it now, not at the release.
                self.holding.arm(outcome.key, 0.0, jitter=False)

    def _apply_flow(self, delivery: Delivery, decision: flow.FlowDecision) -> None:
        outcome = flow.outcome(delivery, decision)
        if isinstance(outcome, Start):  # its window opened after this ask was sent
            delivery.flow_asked_at = delivery.asked_at
        if isinstance(outcome, Skip):
            self._skip(delivery, outcome)
        elif isinstance(outcome, Wait):
            self.holding.hold(delivery, outcome)
        elif delivery.plan.conditions:
            self._ask(delivery)  # debounced: now the task's other conditions
        elif self.cancelling is not None and self.cancelling.in_gate:
            # Debounced and nothing else: no gate call to check a cancel in.
            self._unless_cancelled(delivery, lambda: self.starting.start(delivery, outcome))
        else:
            self.starting.start(delivery, outcome)

    def _unless_cancelled(self, delivery: Delivery, then: Callable[[], None]) -> None:
        """``then()`` once the store said ``delivery`` is not cancelled by id (a check of
        its own: Redis Cluster, or nothing asked of the gate); a cancelled one is revoked.
        A check that failed goes on: a gate ask meets the store's trouble and follows
        the store-down policy."""
        assert self.cancelling is not None
        if not self.cancelling.watch.ids_live():
            then()
            return
        delivery.asking = True  # keeps its pool slot until the store answered

        def answered(cancelled: bool | BaseException) -> None:
            # On the loop; kombu swallows exceptions there: none may escape.
            try:
                with self.holding.lock:
                    delivery.asking = False
                    if delivery.generation != self.generation:
                        return
                    if cancelled is True:
                        self._unrun(delivery)
                        assert self.cancelling is not None
                        self.cancelling.revoke(delivery.request, "cancelled by id")
                    else:
                        then()
            except Exception:
                self._hold_after_error(delivery)
            finally:
                with self.holding.lock:
                    self._settle_slot(delivery)

        self.cancelling.check(delivery.request, answered)

    # -- outcomes -------------------------------------------------------------------

    def _unrun(self, delivery: Delivery) -> None:
        """``delivery`` leaves without running (skipped, revoked, cancelled): an ordered
        call's turn passes to the next call, now or when the line reaches it, rather
        than holding its key for the gap bound (worker/ordering.py)."""
        self._let_go(delivery)
        passed = ordering.passed(delivery.plan)
        if passed is not None:
            self.releasing.channel.release(passed)

    def _drop_cancelled(self, delivery: Delivery, why: str) -> None:
        """A held delivery this worker knows is cancelled leaves, revoked."""
        assert self.cancelling is not None
        self._unrun(delivery)
        self.cancelling.revoke(delivery.request, why)

    def _skip(self, delivery: Delivery, skip: Skip) -> None:
        self._unrun(delivery)
        self.stats["skipped"] += 1
        self.events.skipped(delivery, skip)
        outcomes.skip(delivery.request, skip)
        # Acked without a run: this id will not run (again), so its claim goes. A copy of
        # an id that already ran is one whose ack failed: its run kept the key for it.
        if skip.reason in FREES_UNIQUE and delivery.plan.unique_key:
            self.releasing.free_unique(delivery.plan.unique_key, delivery.request.id)

    def _more_here(self, delivery: Delivery) -> Callable[[str], bool]:
        """For a fair plan's FairTurn key: whether another request of its key waits in
        this worker (not asking now: WaitQueues.others_waiting)."""
        plan = delivery.plan
        return lambda fair: self.holding.others_waiting(
            plan.fair_queues[plan.fair_limits[fair]], delivery
        )

    def _let_go(self, delivery: Delivery) -> None:
        """``delivery`` leaves this worker without a run. A ``fair_key`` request that was
        held: when no other request of its key waits here, this worker's presence in the
        key's turn goes now (fair_leave.lua). Left to lapse, it kept the key ahead of the
        others for ``fairness.PRESENCE``, and they had one slot of the cap fewer
        meanwhile. A leave that fails is only logged: the presence lapses then."""
        held = delivery.held
        self.holding.release(delivery)
        plan = delivery.plan
        if not held or not plan.fair_limits:
            return
        for keys, args in fairness.leave_calls(
            plan.conditions, plan.owner, self._more_here(delivery)
        ):
            self.channel.run("fair_leave", keys, args, _leave_answered)

    def _hand_back(self, delivery: Delivery, why: str, *, one_of_many: bool = False) -> None:
        """Back to the broker; ``one_of_many``: see ``outcomes.hand_back``."""
        self._let_go(delivery)
        self.stats["handed_back"] += 1
        self.events.handed_back(delivery, why)
        outcomes.hand_back(delivery.request, why, one_of_many=one_of_many)

    def start_renewal(self, consumer: Any) -> None:
        """At every consumer start: renew the claims of held messages as they reach the
        horizon, also those that are not at the head of their queue (only a head is
        asked again, and a long queue's tail may wait past the horizon)."""
        if self.renew is None:
            return
        if self._renewal is not None:
            self._renewal.cancel()
        self._renewal = consumer.timer.call_repeatedly(
            max(0.1, self.horizon / 4), self._renew_due, priority=5
        )

    def _renew_due(self) -> None:
        # kombu's timer swallows exceptions: catch everything, no request is lost.
        try:
            with self.holding.lock:
                now = time.monotonic()
                due = [
                    d
                    for d in self.holding.held_deliveries()
                    if now - d.claimed_at >= self.horizon and not d.asking and not d.reserved_start
                ]
                if not due or self.renew is None:
                    return
                for delivery in self.renew(due):
                    self._hand_back(delivery, f"held {now - delivery.since:.0f}s, the horizon")
        except Exception:
            logger.exception("baton: renewing held messages failed")

    def drop_cancelled(self) -> None:
        """A cancel notice (on the loop): the held deliveries it names leave now (acked,
        REVOKED, their event), not at their next turn. One asking the gate is left to
        its answer (its next turn checks again)."""
        if self.cancelling is None:
            return
        try:
            with self.holding.lock:
                for delivery in self.holding.held():
                    if delivery.asking or delivery.generation != self.generation:
                        continue
                    why = self.cancelling.known(delivery.request)
                    if why is not None:
                        self._drop_cancelled(delivery, why)
        except Exception:  # on the loop: never raise there
            logger.exception("baton: dropping cancelled held requests failed")

    def forget_held(self) -> list[Delivery]:
        """Drop every held request (the connection is gone; the broker redelivers them)."""
        with self.holding.lock:
            self.generation += 1
            # A grant asked ahead for a request the broker now gives to others is given
            # back (_take_ahead gives back one past the bound itself). One still asked:
            # its answer finds the generation changed, and gives it back.
            ahead = self.ahead.current
            granted = self._take_ahead(ahead) if ahead is not None else None
            if ahead is not None and granted is not None:
                self.releasing.give_back(ahead.plan)
            forgotten = self.holding.forget()
            # One waiting for its reserved rate slot's instant gives its pool slot back
            # now: its timer may be gone with the connection (Starting.forgotten).
            self.starting.forgotten(forgotten)
            return forgotten


def _rank(request: Any, *, lower_first: bool) -> float | None:
    """A held request's place in its wait queue: an ordered call's position (its key's
    queue holds nothing else), else its message's priority."""
    position = ordering.rank(request)
    if position is not None:
        return position
    return outcomes.urgency(request, lower_first=lower_first)


FREES_UNIQUE = (
    Reason.EXCLUSIVE,
    Reason.SUPERSEDED,
    Reason.ALREADY_RUN,
    Reason.MISFIRE,
    Reason.OUT_OF_ORDER,
)


def _leave_answered(reply: Any) -> None:
    if isinstance(reply, BaseException):
        logger.info("baton: leaving a fair turn failed (it lapses instead): %s", reply)
