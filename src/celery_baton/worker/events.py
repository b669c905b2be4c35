"""Celery task events for what admission decides, so that Flower and `celery events` see it.

Sent through the consumer's own event dispatcher (the one Celery's ``task-received`` and
``task-started`` go through), in Celery's event protocol: a ``task-*`` type with the
task's ``uuid``, hostname, clock and timestamp, so every event consumer
(``app.events.Receiver``, ``celery events``, Flower) files it under the task. Only when
the worker sends task events (``-E``, or ``celery control enable_events``) and the task
does (``Task.send_events``); otherwise nothing is built: one look at the dispatcher.

Celery's ``events.state.State`` (which Flower and ``celery events`` use) makes an unknown
``task-baton-held`` the task's state ``BATON-HELD``, ranked above ``STARTED`` and below
``SUCCESS``/``FAILURE``: a held task shows as held, a skipped one ends as
``BATON-SKIPPED`` with its reason in ``exception`` (the exception its result holds), and
a task admitted after a wait shows ``BATON-ADMITTED`` until it succeeds or fails. A task
admitted at once sends nothing and keeps Celery's own states.

=========================  ==============================================================
type                       fields (besides Celery's own)
=========================  ==============================================================
``task-baton-held``        ``reason``, ``waiting_for`` (in words), ``key``, ``retry_after``
``task-baton-admitted``    ``waited`` (s), ``reason``, ``waiting_for``, ``guarded``
``task-baton-skipped``     ``reason``, ``key``, ``holder``, ``exception``
``task-baton-superseded``  ``replaced_by``, ``key``, ``exception`` (also a terminated run:
                           :func:`run_superseded`)
``task-baton-debounced``   ``replaced_by``, ``key``
``task-baton-throttled``   ``reason`` (throttled or coalesced), ``holder`` or
                           ``replaced_by``, ``key``, ``exception`` (dropped)
``task-baton-handed-back`` ``reason``, ``waited`` (s)
``task-baton-batch``       ``run``, ``calls`` (the batch's call ids): on the call whose
                           request carries the batch (worker/batching.py)
``task-baton-batched``     (none): a held call that ran in a batch, acked by its holder
=========================  ==============================================================
"""

from __future__ import annotations

import time
from typing import Any

from celery_baton.core.debounce import FlowKind
from celery_baton.core.keys import KeyNames, words
from celery_baton.core.policy.model import RunPlan
from celery_baton.errors import TaskSkipped, TaskSuperseded
from celery_baton.worker.holding import Delivery
from celery_baton.worker.verdict import Reason, Skip, Wait

#: What a request waits for, by the reason it waits (``{}``: the key in words).
_WAITING_FOR = {
    Reason.EXCLUSIVE: "exclusive key {}",
    Reason.RUNNING_COPY: "the running copy of this task id",
    Reason.CONCURRENCY: "global_concurrency of {}",
    Reason.RATE: "global_rate_limit of {}",
    Reason.FAIR: "its fair turn at {}",
    Reason.PENALTY: "limit {} (penalized)",
    Reason.GRACE: "the store's grace after it lost its data",
    Reason.STORE_DOWN: "the store, which does not answer",
    Reason.ORDER: "its turn at ordered key {}",
}


class DecisionEvents:
    """The task events of one consumer's decisions; each method sends one kind."""

    def __init__(self, consumer: Any, names: KeyNames) -> None:
        self.consumer = consumer
        self.names = names

    def _dispatcher(self, request: Any) -> Any:
        """The consumer's dispatcher if task events are on now, else None. Read at every
        decision: a lost broker connection replaces it, ``enable_events`` changes it."""
        dispatcher = getattr(self.consumer, "event_dispatcher", None)
        if dispatcher is None or not dispatcher.enabled:
            return None
        if dispatcher.groups and "task" not in dispatcher.groups:
            return None
        return dispatcher if request.task.send_events else None

    # -- one method per decision ----------------------------------------------------

    def held(self, delivery: Delivery, wait: Wait) -> None:
        """``delivery`` waits in the consumer; sent when it first waits, and again when
        it waits for another key. A "skip" duplicate's quarter-second grace is no hold:
        it ends skipped (or admitted) at once."""
        if wait.quiet or wait.key == delivery.announced:
            return
        dispatcher = self._dispatcher(delivery.request)
        if dispatcher is None:
            return
        delivery.announced = wait.key
        delivery.announced_reason = wait.reason.value
        dispatcher.send(
            "task-baton-held",
            uuid=delivery.request.id,
            reason=wait.reason.value,
            waiting_for=self.waiting_for(delivery, wait.reason, wait.key),
            key=self.in_words(delivery, wait.key),
            retry_after=round(wait.delay, 3),
        )

    def admitted(self, delivery: Delivery, *, guarded: bool) -> None:
        """``delivery`` goes to the pool after it was held (one admitted at once sends
        nothing: Flower keeps showing Celery's own states for it)."""
        if delivery.announced is None:
            return
        dispatcher = self._dispatcher(delivery.request)
        if dispatcher is None:
            return
        dispatcher.send(
            "task-baton-admitted",
            uuid=delivery.request.id,
            waited=round(time.monotonic() - delivery.since, 3),
            reason=delivery.announced_reason,
            waiting_for=self.waiting_for(
                delivery, Reason(delivery.announced_reason), delivery.announced
            ),
            guarded=guarded,
        )

    def skipped(self, delivery: Delivery, skip: Skip) -> None:
        """``delivery`` is acked without running: skipped, superseded, debounced or
        throttled, named by the task that holds its key or runs for it."""
        request = delivery.request
        dispatcher = self._dispatcher(request)
        if dispatcher is None:
            return
        key = self.in_words(delivery, skip.key)
        if skip.reason is Reason.SUPERSEDED:
            exception = repr(TaskSuperseded(skip.message, skip.holder))
            dispatcher.send(
                "task-baton-superseded",
                uuid=request.id,
                replaced_by=skip.holder,
                key=key,
                exception=exception,
            )
        elif skip.reason is Reason.COALESCED:
            flow = delivery.policy.flow
            debounced = flow is not None and flow.kind is FlowKind.DEBOUNCE
            fields = {"replaced_by": skip.holder, "key": key}
            if debounced:
                dispatcher.send("task-baton-debounced", uuid=request.id, **fields)
            else:  # a throttle's trailing run stands for it
                dispatcher.send(
                    "task-baton-throttled", uuid=request.id, reason="coalesced", **fields
                )
        elif skip.reason is Reason.THROTTLED:
            dispatcher.send(
                "task-baton-throttled",
                uuid=request.id,
                reason=skip.reason.value,
                holder=skip.holder,
                key=key,
                exception=repr(TaskSkipped(skip.message, key, skip.holder)),
            )
        else:
            self._skipped(dispatcher, request, skip.reason.value, key, skip.holder, skip.message)

    def refused(self, request: Any, message: str) -> None:
        """``request``'s key cannot be built from its arguments: failed, never run."""
        dispatcher = self._dispatcher(request)
        if dispatcher is not None:
            self._skipped(dispatcher, request, "invalid-key", "", "", message)

    def _skipped(
        self, dispatcher: Any, request: Any, reason: str, key: str, holder: str, message: str
    ) -> None:
        dispatcher.send(
            "task-baton-skipped",
            uuid=request.id,
            reason=reason,
            key=key,
            holder=holder,
            exception=repr(TaskSkipped(message, key, holder)),
        )

    def handed_back(self, delivery: Delivery, why: str) -> None:
        """``delivery`` went back to the broker unchanged (held past the horizon, or past
        the worker's window when a store-wide hold ended)."""
        dispatcher = self._dispatcher(delivery.request)
        if dispatcher is not None:
            dispatcher.send(
                "task-baton-handed-back",
                uuid=delivery.request.id,
                reason=why,
                waited=round(time.monotonic() - delivery.since, 3),
            )

    # -- keys in words ----------------------------------------------------------------

    def waiting_for(self, delivery: Delivery, reason: Reason, key: str) -> str:
        """What ``delivery`` waits for, in words: ``exclusive key import_feed(url='…')``."""
        if reason is Reason.DEBOUNCE:
            flow = delivery.policy.flow
            if flow is not None and flow.kind is FlowKind.THROTTLE:
                return f"the throttle window of {self.in_words(delivery, key)}"
            return f"quiet time of {self.in_words(delivery, key)}"
        template = _WAITING_FOR.get(reason, "{}")
        return template.format(self.in_words(delivery, key))

    def in_words(self, delivery: Delivery, key: str) -> str:
        """``key`` as the operator wrote it: its task and the arguments it was made of,
        or a named limit's name; the store key itself when there is nothing better."""
        label = delivery.plan.labels.get(key)
        if label is None:
            return key
        if key in (self.names.shared_rate(label), self.names.shared_penalty(label)):
            return repr(label)
        return words(key, label)


def run_superseded(request: Any, superseded: TaskSuperseded, plan: RunPlan | None) -> None:
    """A running run terminated for a newer publish (``exclusive_conflict="replace"``),
    sent by its own worker as Celery announces the revoke: through the request's own
    dispatcher (``Request.send_event``, which checks that task events are on), just
    before Celery's ``task-revoked``, so the task ends as ``BATON-SUPERSEDED``."""
    key = plan.exclusive_key if plan is not None else None
    label = plan.labels.get(key) if plan is not None and key is not None else None
    request.send_event(
        "task-baton-superseded",
        replaced_by=superseded.replaced_by,
        key=words(key, label) if key is not None and label is not None else "",
        exception=repr(superseded),
    )
