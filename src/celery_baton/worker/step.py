"""The consumer bootstep that installs admission, the lease renewer and the notice listener."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from typing import TYPE_CHECKING, Any

from celery import bootsteps

from celery_baton import metrics
from celery_baton.errors import BatonError
from celery_baton.leases import LeaseBook, Releaser
from celery_baton.store.channel import BlockingChannel, PipelinedChannel
from celery_baton.store.connection import STORE_ERRORS
from celery_baton.worker.admission import Admission

if TYPE_CHECKING:
    from celery_baton.baton import Baton

logger = logging.getLogger("celery_baton.worker")

VISIBILITY_TRANSPORTS = ("redis", "rediss", "sqs", "sentinel")


class NoticeListener(threading.Thread):
    """Listens for released lease keys and wakes the requests held for them."""

    def __init__(self, baton: Baton, admission: Admission) -> None:
        super().__init__(name="baton-notices", daemon=True)
        self.baton = baton
        self.admission = admission
        self._stop_event = threading.Event()

    def run(self) -> None:
        delay = 0.5
        while not self._stop_event.is_set():
            pubsub = None
            try:
                pubsub = self.baton.store.client.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(self.baton.names.notice_channel)
                delay = 0.5
                while not self._stop_event.is_set():
                    message = pubsub.get_message(timeout=1.0)
                    if message and message.get("type") == "message":
                        self.admission.wake(str(message["data"]))
            except STORE_ERRORS as exc:
                logger.debug("notice listener lost the store (%r); reconnecting", exc)
                # Held requests still wake on their timers meanwhile.
                self._stop_event.wait(delay)
                delay = min(delay * 2, 10.0)
            except Exception:
                logger.exception("notice listener crashed; restarting")
                self._stop_event.wait(1.0)
            finally:
                if pubsub is not None:
                    try:
                        pubsub.close()
                    except Exception:  # closing a dead connection may fail; nothing to do
                        logger.debug("closing pubsub failed", exc_info=True)

    def stop(self) -> None:
        self._stop_event.set()


class BatonConsumer(bootsteps.StartStopStep):  # type: ignore[misc]
    """Installed by ``Baton(app)``: ``app.steps["consumer"].add(BatonConsumer)``."""

    label = "baton"
    # After the Tasks step: strategies read on_task_request when they are built,
    # which we replaced in __init__, long before.
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        from celery_baton.baton import baton_for

        baton = baton_for(parent.app)
        self.baton = baton
        self.admission: Admission | None = None
        self.listener: NoticeListener | None = None
        if baton is None:
            return
        baton.validate_all_tasks()
        self.admission = Admission(baton, parent, parent.on_task_request)
        parent.on_task_request = self.admission
        baton.admission = self.admission
        if baton.settings.global_rate_limits:
            self._take_over_rate_limits(parent, baton)
        super().__init__(parent, **kwargs)

    def _take_over_rate_limits(self, consumer: Any, baton: Baton) -> None:
        """Celery's per-worker bucket would throttle a second time: switch it off for the
        tasks whose ``rate_limit`` the gate enforces across all workers. That is every
        task without a declared ``global_rate_limit``, whether it has a ``rate_limit``
        now or gets one later from `celery control rate_limit` (which rebuilds the
        buckets through this method). A task that declares ``global_rate_limit`` keeps
        Celery's bucket for its ``rate_limit``: per worker, as without celery-baton,
        rather than by nobody."""
        original = consumer.bucket_for_task

        def bucket_for_task(task: Any) -> Any:
            policy = baton.policy_for(task)
            return None if policy is not None and policy.rate_from_celery else original(task)

        consumer.bucket_for_task = bucket_for_task
        consumer.reset_rate_limits()

    def start(self, parent: Any) -> None:
        admission, baton = self.admission, self.baton
        if admission is None or baton is None:
            return
        if baton.store.embedded:
            logger.warning(
                "celery-baton is using its embedded store (%s): coordination holds only "
                "between processes on this machine. Set app.conf.baton_url (or $BATON_URL) "
                "to a shared Redis/Valkey to coordinate workers on several machines.",
                baton.store.safe_url,
            )
        self._warn_visibility(parent)
        metrics.serve(baton.settings.metrics_port)
        if admission.book is None:
            admission.book = LeaseBook(
                baton.gate,
                interval=baton.renew_interval,
                on_lost=baton.on_lease_lost,
                on_tick=lambda: self._report(parent),
            )
            admission.book.start()
            hub = getattr(parent, "hub", None)
            if hub is not None and hasattr(baton.store.client, "connection_pool"):
                # The consumer runs an event loop: gate and release calls are pipelined
                # on it and never make it wait for the store.
                admission.channel = PipelinedChannel(
                    baton.store, hub, parent.timer, timeout=baton.settings.socket_timeout
                )
            else:
                admission.channel = BlockingChannel(baton.store)
                admission.releaser = Releaser(baton.gate, on_failure=admission.retry_release)
                admission.releaser.start()
        else:
            # A restart of the consumer (the broker connection was lost): its event loop
            # was reset, so register on it again.
            hub = getattr(parent, "hub", None)
            if isinstance(admission.channel, PipelinedChannel) and hub is not None:
                admission.channel.rebind(hub, parent.timer)
        admission.install_wakeup(parent)
        if self.listener is None:
            self.listener = NoticeListener(baton, admission)
            self.listener.start()
        try:
            self._report(parent)
        except BatonError as exc:
            logger.warning("baton: store unavailable at start (%s); holding guarded tasks", exc)

    def stop(self, parent: Any) -> None:
        # The connection is going away: the broker gives held messages to others again.
        if self.admission is not None:
            dropped = self.admission.forget_held()
            if dropped:
                logger.info("baton: %d held requests left to the broker", dropped)

    def shutdown(self, parent: Any) -> None:
        self.stop(parent)
        if self.listener is not None:
            self.listener.stop()
        if self.admission is not None and self.admission.releaser is not None:
            self.admission.releaser.stop()  # sends what is queued
        if self.admission is not None and isinstance(self.admission.channel, PipelinedChannel):
            self.admission.channel.flush()  # answers for releases already written
        if self.admission is not None:
            self.admission.hand_over_unsent()  # sent by the lease book, just below
        if self.admission is not None and self.admission.book is not None:
            with contextlib.suppress(BatonError):
                self.admission.book.renew_now()  # flush pending releases
            self.admission.book.stop()

    def _report(self, consumer: Any) -> None:
        """Publish this worker's view (held requests, counters) for `celery baton limits`."""
        admission, baton = self.admission, self.baton
        if admission is None or baton is None or admission.book is None:
            return
        report = {
            "hostname": consumer.hostname,
            "held": admission.held_count,
            "held_by_key": admission.held_by_key(),
            "leases": len(admission.book.held()),
            "renewals": admission.book.renewals,
            "losses": admission.book.losses,
            **admission.stats,
        }
        ttl_ms = max(1000, round(baton.renew_interval * 3000))
        try:
            baton.store.client.set(
                baton.names.worker(consumer.hostname), json.dumps(report), px=ttl_ms
            )
        except STORE_ERRORS as exc:
            raise baton.store.unavailable(exc) from exc

    def _warn_visibility(self, consumer: Any) -> None:
        """Warn about tasks that can outlive the broker's visibility timeout."""
        app = consumer.app
        transport = app.connection_for_read().transport_cls
        if isinstance(transport, str) and transport.split("+")[0] not in VISIBILITY_TRANSPORTS:
            return
        options = app.conf.broker_transport_options or {}
        visibility = float(options.get("visibility_timeout", 3600))
        for name, task in sorted(app.tasks.items()):
            if name.startswith("celery."):
                continue
            expected = getattr(task, "expected_runtime", None)
            limit = task.time_limit or app.conf.task_time_limit
            longest = max(x for x in (expected, limit, 0) if x is not None)
            if longest > visibility:
                logger.warning(
                    "task %s may run %ss, longer than the broker's visibility_timeout (%ss): "
                    "its message would be redelivered to another worker while it runs. Raise "
                    "broker_transport_options['visibility_timeout'] above %ss, and/or set "
                    "baton_redelivery_guard = True so the copy never runs twice.",
                    name,
                    longest,
                    visibility,
                    longest,
                )
