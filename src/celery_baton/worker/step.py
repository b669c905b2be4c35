"""The consumer bootstep: builds the worker's parts and puts admission before the pool.

Installed by ``Baton(app)``; Celery builds it from the app alone, so it finds the app's
parts through ``parts.installed_parts(app)``, the one app -> parts lookup. Following Celery's
contract: ``include_if`` says whether the app uses celery-baton at all, ``create``
builds every part once (the gate channel, the lease book, releasing, admission, the
notice listener), ``start`` runs at every consumer start (also after a lost broker
connection, when Celery has reset the event loop), ``stop`` and ``shutdown`` hand back
what is held and release what is owed.
"""

from __future__ import annotations

import datetime
import functools
import logging
from collections.abc import Callable
from typing import Any

from celery import bootsteps
from celery import signals as celery_signals
from celery.worker import state as worker_state
from celery.worker.request import Request

from celery_baton import internals, metrics
from celery_baton.core.gate_channel import GateChannel
from celery_baton.core.leases import LeaseBook
from celery_baton.core.notices import HEARTBEAT, REPORT_TTL, NoticeListener, WorkerReports
from celery_baton.core.recorded_ends import RecordedEnds
from celery_baton.core.revoke_notices import parse_revoke_notice, tell
from celery_baton.errors import BatonError, ConfigError
from celery_baton.parts import AppParts, installed_parts
from celery_baton.worker import ordering, pool_work
from celery_baton.worker.admission import Admission
from celery_baton.worker.batching import Batching, tick_interval
from celery_baton.worker.cancelling import Cancelling, revoke_refused_starts
from celery_baton.worker.pool import cancel_start, run_end, stand_ins
from celery_baton.worker.pool.batch_run import wrap_task
from celery_baton.worker.pool.flush import keep_running_jobs
from celery_baton.worker.pool.job_end import refuse_unstoppable_replace
from celery_baton.worker.releasing import Releasing
from celery_baton.worker.replacing import keep_superseded_on_revoke
from celery_baton.worker.request import unique_key_of
from celery_baton.worker.revoked_first import free_claims_on_revoke, free_held_claims
from celery_baton.worker.store_down import warn_eviction
from celery_baton.worker.told_revokes import revoke_told, takes_told_revokes
from celery_baton.worker.transport import broker_close, intake_together
from celery_baton.worker.transport.broker import (
    hold_horizon,
    read_broker,
    warn_long_tasks,
    warn_short_gaps,
)
from celery_baton.worker.transport.broker_writes import BrokerWrites
from celery_baton.worker.transport.consumer_window import ConsumerWindow
from celery_baton.worker.transport.held_renewal import HeldRenewal
from celery_baton.worker.transport.held_return import HeldReturn
from celery_baton.worker.unsent import UnsentReleases

#: Seconds a worker keeps the ends it recorded, to write them again on a store that
#: forgot them (not Sentinel, where the sentinels' down-after says).
KEEP_ENDS_FOR = 60.0

logger = logging.getLogger("celery_baton.worker")


def _task_channel(consumer: Any) -> Any:
    """The channel the consumer receives tasks on (None before the Tasks step made it)."""
    return getattr(getattr(consumer, "task_consumer", None), "channel", None)


def _deliver(consumer: Any, message: Any) -> None:
    """Hand ``message`` to the consumer as a new delivery, on its loop's first turn
    (Celery's loop sets the task consumer's message handler when it starts)."""

    def delivered() -> None:
        on_message = getattr(getattr(consumer, "task_consumer", None), "on_message", None)
        if on_message is None:  # not consuming yet: kept in its channel meanwhile
            consumer.timer.call_after(0.1, delivered)
            return
        on_message(message)

    consumer.timer.call_after(0, delivered)


def _parts(parent: Any) -> AppParts | None:
    return installed_parts(parent.app)


def _replacing_here(parts: AppParts) -> list[str]:
    """The tasks declared ``exclusive_conflict="replace"`` that this worker consumes (by
    their route without arguments; a task whose route cannot be read counts)."""
    app = parts.app
    consumed = app.amqp.queues.consume_from
    names = []
    for name, task in sorted(app.tasks.items()):
        policy = parts.policy_for(task)
        if policy is None or policy.exclusive is None or policy.exclusive_conflict != "replace":
            continue
        try:
            queue = app.amqp.router.route({}, name)["queue"].name
        except Exception:  # a router that needs the arguments
            queue = None
        if queue is None or not consumed or queue in consumed:
            names.append(name)
    return names


class BatonConsumer(bootsteps.StartStopStep):  # type: ignore[misc]
    """Installed by ``Baton(app)``: ``app.steps["consumer"].add(BatonConsumer)``."""

    label = "baton"
    # After the Tasks step: strategies read on_task_request when they are built,
    # which we replace in create(), long before.
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def include_if(self, parent: Any) -> bool:
        return _parts(parent) is not None

    def create(self, parent: Any) -> BatonWorker:
        parts = _parts(parent)
        assert parts is not None  # include_if
        try:
            return BatonWorker(parts, parent)
        except ConfigError as exc:
            # A bad setting or task option stops the worker with one line naming it, not a
            # traceback through Celery's bootsteps that ends in that line.
            raise SystemExit(f"celery_baton.errors.{type(exc).__name__}: {exc}") from None

    # Celery calls these with the consumer; the parts need it (its loop is new after a
    # lost broker connection).
    def start(self, parent: Any) -> None:
        self.obj.start(parent)

    def stop(self, parent: Any) -> None:
        self.obj.stop(parent)

    def shutdown(self, parent: Any) -> None:
        self.obj.shutdown(parent)

    def terminate(self, parent: Any) -> None:
        self.obj.shutdown(parent)


def _prepare_pool(task_pool: Any) -> None:
    """Celery's prefork pool, about to start: its processes say when one can start a
    request, and judge a late rate grant or throttle before they accept the job
    (pool/prefork.py); Celery's gevent and eventlet pools judge them on the greenlet,
    its threads pool on the executor thread (pool/in_process.py).
    A prefork pool that cannot be told so is refused: its limits would not hold."""
    # Imported here, by a worker: the prefork pool's modules are not a client's.
    from celery.concurrency.prefork import TaskPool

    from celery_baton.worker.pool import green, in_process, prefork

    green.install(task_pool)  # gevent, eventlet: a reconnect lets the greenlets run

    # gevent, eventlet: judged on the greenlet, threads: on the executor thread, before
    # the body.
    for pool, shaped, expected, install in (
        ("gevent", internals.gevent_pool, "on_start sets _quick_put", in_process.install),
        ("eventlet", internals.eventlet_pool, "on_start sets _quick_put", in_process.install),
        (
            "threads",
            internals.threads_pool,
            "on_apply takes accept_callback",
            in_process.install_threads_and_solo,
        ),
    ):
        known = shaped(task_pool)
        if known is False:
            raise ConfigError(
                f"Celery's {pool} pool is not as celery-baton knows it ({expected}): a rate "
                "grant or a throttle window would not be judged at the task's start"
            )
        if known:
            install(task_pool)
            return
    if not isinstance(task_pool, TaskPool):
        # solo: tasks start in the main process as they are handed over, and are judged
        # there as on a thread (a worker that stood still hands them over late).
        if type(task_pool).__module__ == "celery.concurrency.solo":
            in_process.install_threads_and_solo(task_pool)
        return
    refused = prefork.install(task_pool)
    if refused is not None:
        raise ConfigError(f"{refused}: global limits could not hold at the task's start")


def _batching(
    parts: AppParts,
    consumer: Any,
    redelivery: float | None,
    cancelling: Cancelling,
    on_loop: Callable[[Callable[[], None]], None],
    window: ConsumerWindow,
) -> Batching | None:
    """The consumer's batching, when the app has a batched task (their bodies made batch
    runners, also those declared before ``Baton(app)``)."""
    waits = []
    for task in list(parts.app.tasks.values()):
        policy = parts.policy_for(task)
        if policy is not None and policy.batch is not None:
            wrap_task(task)
            waits.append(policy.batch.wait)
    if not waits:
        return None
    settings = parts.settings
    return Batching(
        consumer,
        parts.batches,
        send=lambda request: None,  # set once admission made the pool slots
        presence=settings.lease_ttl,
        # A done call is remembered while its message could still come back.
        keep=max(redelivery or settings.redelivery_retention, 4 * settings.lease_ttl),
        interval=tick_interval(waits),
        hold_max=settings.hold_max,
        cancelling=cancelling,
        on_loop=on_loop,
        window=window,
    )


class BatonWorker:
    """The worker side of one consumer: its parts, built once, started at every start."""

    def __init__(self, parts: AppParts, parent: Any) -> None:
        parts.validate_all_tasks()  # a bad option stops the worker at start
        _prepare_pool(getattr(parent, "pool", None))
        refuse_unstoppable_replace(getattr(parent, "pool", None), _replacing_here(parts))
        self.broker = broker = read_broker(parts.app)
        # Held messages a crashed broker could not take back (kombu's Redis transport).
        self.held_return = (
            HeldReturn(broker.visibility) if broker.kombu_redis and broker.visibility else None
        )
        if broker.kombu_redis:
            broker_close.finish_interrupted_closes()  # a broker crash must not kill it
        if any(
            policy is not None and policy.flow is not None
            for policy in map(parts.policy_for, list(parts.app.tasks.values()))
        ):
            # Only a debounced (or throttle-trailing) run stands for other publishes.
            # Built before the pool starts, so its processes inherit the receiver.
            # Every task_postrun receiver is called after every task in every pool
            # process (4-12 us each on a small machine), so only when it can matter.
            stand_ins.install()
        self.parts = parts
        # Without a mailbox, the revokes celery-baton sends (a replaced run, a cancel's
        # terminate) come on the notice channel (worker/told_revokes.py).
        self._told_revokes_to = parent if takes_told_revokes(parts.app) else None
        # Before the pool forks: its processes inherit the table they say their
        # recorded ends in.
        shared_ends = run_end.share_ends()
        self.book = LeaseBook(
            parts.gate,
            ending=shared_ends.ending,
            interval=parts.renew_interval,
            on_lost=parts.on_lease_lost,
            on_tick=lambda: self._report(parent),
            heartbeat=HEARTBEAT,
            on_heartbeat=lambda: self._heartbeat(parent),
        )
        self.unsent = UnsentReleases(self.book, parent.timer)
        # The worker's records and acks on a Redis broker, their replies not waited for.
        self.broker_writes = BrokerWrites()
        self.releasing = Releasing(
            self.book,
            parent.timer,
            self.unsent,
            hub=getattr(parent, "hub", None),
            broker_writes=self.broker_writes,
            redelivery_window=broker.redelivery_window,
            recorded=_recorded_ends(parts),
            shared_ends=shared_ends,
        )
        self.channel = GateChannel(
            parts.gate,
            # The consumer runs an event loop: gate and release calls are pipelined on
            # it and never make it wait for the store.
            hub=getattr(parent, "hub", None),
            timer=parent.timer,
            timeout=parts.settings.socket_timeout,
            on_release_failed=self.unsent.add,
            on_answered=self.unsent.store_answered,
        )
        self.unsent.attach(self.channel)
        self.releasing.attach(self.channel)
        horizon = hold_horizon(parts.settings.hold_horizon, broker.visibility)
        # Sticky cancels (baton.cancel): every delivery is screened before admission.
        self.cancelling = Cancelling(
            parts.cancels,
            self.channel,
            # Before the pool forks: the ids it is told of, read where jobs start.
            noticed=cancel_start.share_cancels(),
            keep_noticed=horizon,
            generation=lambda: self.admission.generation,
            in_gate=not parts.store.cluster,
        )
        # A unique call cancelled while it waits here unstarted frees its key at once:
        # a publish after the cancel returned is a new run (cancel.py waits for it).
        self.cancelling.on_cancelled = lambda ids: self.releasing.door.run(
            lambda: free_held_claims(ids)
        )
        # Where RabbitMQ keeps each consumer's prefetch fixed, held requests (and batched
        # calls) would take it.
        self.window = ConsumerWindow(
            waiting=self._waiting,
            held_messages=lambda: [
                *self.admission.holding.counted_messages(),
                *(self.batching.counted_messages() if self.batching is not None else ()),
            ],
        )
        self.batching = _batching(
            parts,
            parent,
            broker.redelivery_window,
            self.cancelling,
            self.releasing.door.run,
            self.window,
        )
        self.admission = Admission(
            parent,
            parent.on_task_request,
            policy_for=parts.policy_for,
            names=parts.names,
            channel=self.channel,
            book=self.book,
            releasing=self.releasing,
            settings=parts.settings,
            horizon=horizon,
            lower_priority_first=broker.kombu_redis,
            window=self.window,
            # Held messages stay past the horizon where the broker's claim can be renewed.
            renew=HeldRenewal().renew if broker.kombu_redis and broker.visibility else None,
            cancelling=self.cancelling,
            batching=self.batching,
        )
        if self.batching is not None:
            self.batching.send = self.admission.carry  # a batch's carrier: one run
        # A replaced run's revoke, told on the notice channel too (told_revokes.py).
        self.admission.replacing.tell = functools.partial(
            tell, parts.store, parts.names.notice_channel
        )
        parent.on_task_request = self.admission
        self.channel.on_recovered = self.admission.store_down.recovered
        self.listener = NoticeListener(
            parts.store,
            parts.names.notice_channel,
            self._noticed,
            # A job starting while the notices went unheard lately asks the store itself.
            on_heard=cancel_start.share_cancels().heard,
            on_connected=self._notices_back,
        )
        revoke_refused_starts(Request)
        self.reports = WorkerReports(parts.store, parts.names)
        self._started = False
        self._shut = False
        self._reopens_told = 0
        if parts.settings.global_rate_limits and getattr(parent, "disable_rate_limits", False):
            # worker_disable_rate_limits: this worker enforces no Celery rate_limit, as
            # without celery-baton (global_rate_limit, celery-baton's own, still holds).
            self.admission.planner.celery_rates_off = True
            logger.info(
                "baton: worker_disable_rate_limits: Celery's rate_limit is not enforced by "
                "this worker, also where baton_global_rate_limits made it global"
            )
        elif parts.settings.global_rate_limits:
            self._take_over_rate_limits(parent, parts)
        # Without Celery's Request._announce_revoked, its task_revoked signal ends a run.
        self._revoked_by_signal = "_announce_revoked" in internals.missing_request_hooks(Request)
        panel = internals.control_panel()
        if panel is not None:  # a replaced run's TaskSuperseded outlives the revoke
            keep_superseded_on_revoke(panel)
            free_claims_on_revoke(panel)  # a not-started task's unique key, before REVOKED
        celery_signals.task_revoked.connect(self._on_revoked, weak=False)
        celery_signals.task_received.connect(self._on_received, weak=False)
        celery_signals.celeryd_after_setup.connect(self._name_store_in_banner, weak=False)

    def describe(self) -> str:
        """This worker's celery-baton in one line: its store (no password), where that
        URL came from, its role and how many tasks it guards."""
        parts = self.parts
        names = [t.name for t in list(parts.app.tasks.values()) if parts.policy_for(t)]
        # Celery's own (celery.chord_unlock...) are guarded under an app-wide guard too:
        # counted apart, so the count is the user's tasks.
        own = sum(1 for name in names if not str(name).startswith("celery."))
        celerys = f" (+{len(names) - own} of Celery's own)" if len(names) > own else ""
        return (
            f"{parts.store.safe_url} (from {parts.settings.url_source}), role worker, "
            f"{own} guarded task{'s' if own != 1 else ''}{celerys}"
        )

    def _name_store_in_banner(self, sender: Any = None, instance: Any = None, **kw: Any) -> None:
        """Beat's banner names its store; the worker's gets a line too (printed at any
        log level, as the banner is), and the log one at INFO."""
        if getattr(instance, "app", None) is not self.parts.app:
            return
        line = self.describe()
        logger.info("celery-baton: store %s", line)
        startup_info = getattr(instance, "startup_info", None)
        if callable(startup_info):  # a line of Celery's banner, beside .> transport:

            def with_baton(*args: Any, **kwargs: Any) -> str:
                lines = str(startup_info(*args, **kwargs)).split("\n")
                queues = next((i for i, t in enumerate(lines) if "[queues]" in t), len(lines))
                config = [i for i, text in enumerate(lines[:queues]) if ".> " in text]
                at = config[-1] + 1 if config else len(lines)
                indent = " " * (lines[at - 1].find(".> ") if config else 0)
                lines.insert(at, f"{indent}.> baton:       {line}")
                return "\n".join(lines)

            instance.startup_info = with_baton

    def _take_over_rate_limits(self, consumer: Any, parts: AppParts) -> None:
        """Celery's per-worker bucket would throttle a second time: switch it off for the
        tasks whose ``rate_limit`` the gate enforces across all workers. That is every
        task without a declared ``global_rate_limit``, whether it has a ``rate_limit``
        now or gets one later from `celery control rate_limit` (which rebuilds the
        buckets through this method). A task that declares ``global_rate_limit`` keeps
        Celery's bucket for its ``rate_limit``: per worker, as without celery-baton,
        rather than by nobody."""
        original = consumer.bucket_for_task

        def bucket_for_task(task: Any) -> Any:
            policy = parts.policy_for(task)
            return None if policy is not None and policy.rate_from_celery else original(task)

        consumer.bucket_for_task = bucket_for_task
        consumer.reset_rate_limits()

    def start(self, parent: Any) -> None:
        parts = self.parts
        if not self._started:
            self._started = True
            if parts.store.embedded:
                logger.warning(
                    "celery-baton is using its embedded store (%s): coordination holds "
                    "only between processes on this machine. Set app.conf.baton_url (or "
                    "$BATON_URL) to a shared Redis/Valkey to coordinate workers on several "
                    "machines.",
                    parts.store.safe_url,
                )
            keep_running_jobs(getattr(parent, "pool", None))
            self.admission.slots.attach(getattr(parent, "pool", None))
            warn_long_tasks(parent.app, self.broker.visibility)
            warn_short_gaps(
                map(parts.policy_for, list(parent.app.tasks.values())),
                self.broker.redelivery_window,
            )
            warn_eviction(parts.gate)
            metrics.serve(parts.settings.metrics_port)
            self.cancelling.refresh()  # a worker started after a cancel knows of it
            self.book.start()
            self.listener.start()
        else:
            # A restart of the consumer (the broker connection was lost): its event loop
            # was reset, so register on it again.
            self.channel.rebind(getattr(parent, "hub", None), parent.timer)
            self.releasing.restart(parent.timer)
            self.admission.slots.restart()
            self.admission.hold_end.restart()
            if self.held_return is not None:
                self.held_return.put_back(
                    _task_channel(parent),
                    deliver=lambda message: _deliver(parent, message),
                    unrecorded=self.broker_writes.put_back_unrecorded,
                )
        self.admission.holding.install_wakeup(parent)
        if self.batching is not None:
            self.batching.start(parent)
        # Messages taken from a Redis broker several at a time when a backlog waits: the
        # consumer's one thread was a drain's bound, one round trip per message.
        # Recorded and acked without waiting for the broker's replies (the loop's other
        # round trips per message); first: the intake records through it.
        self.broker_writes.install(
            _task_channel(parent), getattr(parent, "hub", None), parent.timer
        )
        intake_together.install(_task_channel(parent), window=lambda: parent.qos.value)
        # Held requests are not the pool's work: Celery's sizing by reserved requests
        # (worker_disable_prefetch, --autoscale) leaves them out.
        pool_work.install_intake(parent, _task_channel(parent), held=self._held_here)
        pool_work.install_autoscaler(
            getattr(getattr(parent, "controller", None), "autoscaler", None), self._held_here
        )
        self.window.start(parent)
        self.admission.start_renewal(parent)
        self.releasing.door.install(parent)  # runs ended on the threads pool's threads
        try:
            self._report(parent)
        except BatonError as exc:
            logger.warning("baton: store unavailable at start (%s); holding guarded tasks", exc)

    def _held_here(self) -> int:
        """Requests in this worker that wait without a pool process: held for a limit,
        or batched calls waiting for their batch."""
        batched = self.batching.held_count() if self.batching is not None else 0
        return int(self.admission.holding.held_count) + batched

    def _waiting(self) -> int:
        """Requests in this worker waiting for a pool process (not running, not held)."""
        reserved = len(worker_state.reserved_requests) - len(worker_state.active_requests)
        return max(0, reserved - self._held_here())

    def stop(self, parent: Any) -> None:
        # Before kombu's channel closes and restores what it counts delivered: every write
        # in flight answered (or given up), so that no restore overtakes one.
        self.broker_writes.settle()
        # The connection is going away: the broker gives held messages to others again.
        forgotten = self.admission.forget_held()
        if forgotten:
            logger.info("baton: %d held requests left to the broker", len(forgotten))
        batched = self.batching.forget() if self.batching is not None else []
        if batched:
            logger.info("baton: %d batched calls held left to the broker", len(batched))
        if self.window.reopened > self._reopens_told:
            self._reopens_told = self.window.reopened
            logger.info(
                "baton: the task consumer was opened again %d times for held requests",
                self.window.reopened,
            )
        if parent.blueprint.state == bootsteps.RUN:  # a restart: the connection was lost
            if self.held_return is not None:
                self.held_return.remember(forgotten, _task_channel(parent), batched)
            unstarted = self.releasing.drop_unstarted(worker_state.active_requests)
            if unstarted:
                logger.info(
                    "baton: %d admitted requests dropped by Celery with the connection; "
                    "their keys given back",
                    unstarted,
                )

    def shutdown(self, parent: Any) -> None:
        if self._shut:
            return
        self._shut = True
        self.stop(parent)
        self.listener.stop()
        self.releasing.door.close()  # the runs' ends handed to the loop, sent below
        self.broker_writes.close()  # the writes in flight answered; then kombu's own
        self.releasing.run_after_acks()  # and those that waited for their ack
        self.channel.close()  # sends what is queued, answers what was sent
        self.unsent.hand_over()  # sent by the lease book, just below
        try:
            self.book.renew_now()  # retries releases that failed
        except BatonError as exc:
            keys = self.book.unsent_keys()
            if keys:
                # Nothing is lost (a lease cannot outlive its lease_ttl), but a key the
                # operator sees held after the worker stopped must be explained.
                logger.warning(
                    "baton: the store did not take %d releases at shutdown (%s): %s stay "
                    "held until their lease_ttl runs out (`celery baton unlock` frees one "
                    "now)",
                    len(keys),
                    exc,
                    ", ".join(sorted(set(keys))),
                )
        self.book.stop()
        # A clean stop leaves `celery baton status` at once, not when its report expires.
        self.reports.remove(parent.hostname)

    def _on_received(self, sender: Any = None, request: Any = None, **kwargs: Any) -> None:
        """A unique task that will wait here for its countdown or ETA is marked under its
        id, so that ``baton.cancel`` of it frees its key at once (worker/cancelling.py).
        Every delivery passes here: one that has no ETA returns first.

        # assumes: Celery's strategy sends task_received before it puts an ETA request in
        # its timer, which hands it to on_task_request (admission) at its time, on every
        # pool (tests/unique/test_after_the_result.py: prefork, gevent, threads, solo)."""
        eta = getattr(request, "eta", None)
        if eta is None:
            return
        delay = (eta - datetime.datetime.now(eta.tzinfo)).total_seconds()
        if delay <= 0:
            return
        key = unique_key_of(self.parts, request)
        if key is not None:
            self.cancelling.hold_for_later(request, key, delay)

    def _on_revoked(self, sender: Any = None, request: Any = None, **kwargs: Any) -> None:
        """A task revoked (or expired) before it was admitted frees its unique key and
        passes its ordered turn; on the consumer's loop, so through the gate channel,
        never a blocking call."""
        if sender is None or request is None:
            return
        if self._revoked_by_signal:
            self.releasing.revoked(request.id, terminated=bool(kwargs.get("terminated")))
        if self.parts.app.tasks.get(sender.name) is not sender:
            return
        policy = self.parts.policy_for(sender)
        if policy is None or (policy.unique is None and policy.ordered is None):
            return
        names = self.parts.names
        args, task_kwargs = request.args or (), request.kwargs or {}
        try:
            if policy.unique is not None:
                key = policy.unique_key(names, args, task_kwargs)
                self.releasing.free_unique(key, request.id)
            # (No lease to free: the owner names nobody's.)
            passed = ordering.passed_unadmitted(policy, names, request, request.id)
        except BatonError as exc:
            logger.warning("revoked %s[%s]: its keys: %s", sender.name, request.id, exc)
            return
        if passed is not None:
            self.channel.release(passed)

    def _report(self, consumer: Any) -> None:
        """Publish this worker's view (held requests, counters) for `celery baton status`."""
        admission = self.admission
        stats = dict(admission.stats)
        batched = self.batching.held_count() if self.batching is not None else 0
        report = {
            **stats,
            # "held" is the number held now; the running total has its own name (it
            # used to overwrite this one, and `celery baton status` showed the total).
            "holds_total": stats.pop("held", 0),
            "hostname": consumer.hostname,
            "held": admission.holding.held_count + batched,
            "held_by_key": admission.holding.held_by_key(),
            # Calls of batched tasks waiting for their batch here (also in "held").
            "batched": batched,
            "leases": len(self.book.held()),
            "renewals": self.book.renewals,
            "losses": self.book.losses,
        }
        self.reports.write(consumer.hostname, report, ttl=REPORT_TTL)

    def _noticed(self, text: str) -> None:
        """A notice (the listener's thread): a cancel, a revoke, or a released key."""
        told = parse_revoke_notice(text)
        if told is not None:
            consumer = self._told_revokes_to
            if consumer is not None:
                self.releasing.door.run(lambda: revoke_told(consumer, told))
            return
        if self.cancelling.notice(text):
            self.admission.holding.wake_for_cancel(self.admission.drop_cancelled)
        else:
            self.admission.holding.wake(text)

    def _notices_back(self) -> bool:
        """The notice listener (re)subscribed (its thread): what its notices would have
        said meanwhile is read from the store (cancels), then every held request asks
        again (a release may have been missed). False: the store did not answer, and
        nothing is woken (the listener calls again; a held request would only meet the
        store's failure, and the gate channel's recovery wakes every one)."""
        if not self.cancelling.caught_up():
            return False  # asked again at the next poll: wake the held requests then
        self.admission.holding.notices_missed()
        return True

    def _heartbeat(self, consumer: Any) -> None:
        self.cancelling.heartbeat()
        self._alive(consumer)

    def _alive(self, consumer: Any) -> None:
        """Between reports, keep this one alive (one PEXPIRE); write it if it is gone.
        Gone, the store may have forgotten (restarted empty, a replica promoted): the
        ends recorded lately are written again."""
        if not self.reports.touch(consumer.hostname):
            recorded = self.releasing.recorded
            if recorded is not None:
                recorded.write_back("the store forgot this worker's report")
            self._report(consumer)


def _recorded_ends(parts: AppParts) -> RecordedEnds:
    """The ends this worker records, written again when the store may have lost them
    (core/recorded_ends.py): on Sentinel when the master changes, kept as long as
    Sentinel may promote a replica that was behind (ten times its down-after, plus one
    for the master's own detection); on Redis Cluster when the master of a slot they
    live on changes (watched by the ends themselves); on any store when it forgot
    (``_alive``, and a grace refusal: worker/store_down.py)."""
    watch = parts.store.master_watch
    if watch is None:
        return RecordedEnds(
            parts.gate.release_many, keep_for=KEEP_ENDS_FOR, shards=parts.store.shards
        )
    recorded = RecordedEnds(parts.gate.release_many, keep_for=11 * watch.down_after())
    watch.on_change.append(recorded.write_back)
    return recorded
