"""The gate on the worker's hot path: asks and releases answered through callbacks.

The worker's consumer runs an event loop that must never wait for the store. When it
has one, the gate's calls are pipelined on it (``store.channel.PipelinedChannel``):
written before the loop polls, answered when the socket is readable. Without one (solo
and threads pools) asks are answered at once and releases go out from a background
thread, batched. Which of the two is chosen once, when the worker starts; the worker
never sees the difference, and never imports ``store/``. Celery-free.

Every call is answered exactly once: a :class:`~celery_baton.core.gate.Decision` (or the
number a release freed), or the exception that stopped it (``StoreUnavailable`` when
the store did not answer: a call may still have been executed by the store then, so
whatever an ask may have granted must be given back; see ``worker/releasing.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from celery_baton.core.conditions import Condition, spans_slots
from celery_baton.core.gate import Decision, Gate, Release
from celery_baton.core.leases import Releaser
from celery_baton.store.channel import BlockingChannel, PipelinedChannel

logger = logging.getLogger("celery_baton.core.gate")

AskAnswer = Callable[["Decision | BaseException"], None]


class GateChannel:
    """``ask`` and ``release`` for one worker; pipelined when ``hub`` is given.

    ``on_release_failed(release)`` gets every release the store did not confirm, to be
    retried later; none is dropped. ``on_answered()`` is called whenever the store
    answered a call: it is executing commands again (what was sent before, on any
    connection, has been read by then). ``on_recovered()`` (set after construction) is
    called once when the store answers after a call failed for want of it: a release
    notice may have been lost meanwhile (a new master, a broken subscription), so
    whatever waits should ask again.
    """

    def __init__(
        self,
        gate: Gate,
        *,
        hub: Any = None,
        timer: Any = None,
        timeout: float = 2.0,
        on_release_failed: Callable[[Release], None],
        on_answered: Callable[[], None] = lambda: None,
    ) -> None:
        self.gate = gate
        self.on_release_failed = on_release_failed
        self.on_answered = on_answered
        self.on_recovered: Callable[[], None] = lambda: None
        self._failed = False  # a call failed since the store last answered
        self.pipelined = hub is not None and not gate.store.cluster
        self._channel: PipelinedChannel | BlockingChannel
        self._releaser: Releaser | None = None
        if self.pipelined:
            self._channel = PipelinedChannel(gate.store, hub, timer, timeout=timeout)
        else:
            self._channel = BlockingChannel(gate.store)
            self._releaser = Releaser(gate, on_failure=on_release_failed)
            self._releaser.start()

    def ask(
        self,
        conditions: Sequence[Condition],
        *,
        owner: str,
        ttl: float,
        reserve: float,
        answer: AskAnswer,
    ) -> None:
        """Ask for every condition at once; ``answer`` gets the Decision or the error."""
        if not self.pipelined and self.gate.store.cluster and spans_slots(conditions):
            # Named limits on their own Cluster slots: reserve then confirm, several
            # calls in a row (Gate.decide); Cluster asks are answered at once anyway.
            try:
                decided: Decision | BaseException = self.gate.decide(
                    conditions, owner=owner, ttl=ttl, reserve=reserve
                )
            except Exception as exc:
                decided = exc
            if isinstance(decided, Decision):
                self._ok()
            else:
                self._failed = True
            answer(decided)
            return
        keys, args = self.gate.call(conditions, owner, ttl, reserve)

        def answered(reply: Any) -> None:
            if isinstance(reply, BaseException):
                self._failed = True
                answer(reply)
                return
            try:
                decision = self.gate.decision(conditions, reply)
            except Exception as exc:  # a reply we cannot read: answer with it, never raise
                answer(exc)
                return
            self._ok()
            answer(decision)

        # Urgent: the request is asked when a pool process can start it, and the
        # process idles until the answer.
        self._channel.call("gate", keys, args, answered, urgent=True)

    def run(
        self, script: str, keys: Sequence[str], args: Sequence[Any], answer: Callable[[Any], None]
    ) -> None:
        """Another decision script on the same channel (debounce, throttle); ``answer``
        gets its raw reply or the error."""

        def answered(reply: Any) -> None:
            if not isinstance(reply, BaseException):
                self._ok()
            else:
                self._failed = True
            answer(reply)

        self._channel.call(script, keys, args, answered)

    def release(self, release: Release) -> None:
        """Give back what ``release`` names; retried through ``on_release_failed``."""
        if self._releaser is not None:
            self._releaser.submit(release)  # sent from a thread, batched
            return
        keys, args = release.script_call(self.gate.notice_channel)

        def answered(reply: Any) -> None:
            if isinstance(reply, BaseException):
                logger.warning("release failed, retrying in the background: %s", reply)
                self._failed = True
                self.on_release_failed(release)
            else:
                self._ok()

        self._channel.call("release", keys, args, answered)

    def ping(self, answer: Callable[[Any], None]) -> None:
        """PING the store (pipelined only): a reply proves it executes commands again."""
        if isinstance(self._channel, PipelinedChannel):

            def answered(reply: Any) -> None:
                if isinstance(reply, BaseException):
                    self._failed = True
                else:
                    self._ok()
                answer(reply)

            self._channel.ping(answered)

    def _ok(self) -> None:
        """The store answered a call."""
        self.on_answered()
        if self._failed:
            self._failed = False
            self.on_recovered()

    def rebind(self, hub: Any, timer: Any) -> None:
        """The consumer restarted (lost broker connection): its event loop was reset."""
        if isinstance(self._channel, PipelinedChannel) and hub is not None:
            self._channel.rebind(hub, timer)

    def close(self) -> None:
        """Send what is queued and answer what was sent (at shutdown)."""
        if self._releaser is not None:
            self._releaser.stop()
        if isinstance(self._channel, PipelinedChannel):
            self._channel.flush()
