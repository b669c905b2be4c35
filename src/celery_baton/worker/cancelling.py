"""Sticky cancels in the worker (``baton.cancel``; core/cancels.py holds the records).

Every delivery is screened before it starts (``Admission``): in memory at its entry
(:meth:`Cancelling.known`: the ids this worker was told of, the key cancels of its
task), then in the store while cancels by id live. A cancelled one is revoked the way
Celery revokes (its id joins the worker's revoked set, and ``Request.revoked()`` sends
the ``task-revoked`` event, marks the result ``REVOKED``, acks the message, sends
``task_revoked`` and logs Celery's "Discarding revoked task"; the line before it says
why), so it never starts and its message never comes back. That covers a message in
the broker (checked when a worker receives it, whichever worker, whenever it started),
an ETA or countdown (checked when Celery's timer hands it on), a retry's re-publish and
a redelivered copy (the same id). A delivery held by admission is dropped when a
notice names it, and checked again at its next turn.

A call screened, then waiting in the worker for a pool process (every process busy),
is judged again where its job starts (``worker/pool/cancel_start.py``), from what this
worker noticed since, in memory its pool processes share (core/shared_cancels.py): each
id a notice names, and each call this worker holds that a cancel by key it learns of
covers (:meth:`Cancelling.mark_held`: matched here, once per cancel, against the calls
it holds, not at every start). A worker that has not heard its notices lately (it stood
still, or its notice connection is being made again) does not know: there the start
asks the store itself, and when the connection is back the calls held here are read
anew (:meth:`Cancelling.caught_up`). A request whose start refused it revokes itself
(:func:`revoke_refused_starts`).

What a delivery pays: nothing while no cancel by id lives (the worker knows from the
store-wide marker, re-read on every notice and every ``REFRESH`` seconds); key
cancels are matched in memory; while cancels by id live, one check pipelined on the
gate channel (``cancel_check.lua``) for a delivery that asks the gate nothing, and
none of its own for one that asks the gate: the gate call checks it (``NotCancelled``,
gate/not_cancelled.lua; on Redis Cluster, where the id's record is on a slot of its
own, a call of its own beside it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from celery.worker import state as worker_state

from celery_baton.core.cancels import (
    ID_FIELD,
    REFRESH,
    Cancels,
    CancelWatch,
    KeyCancel,
    parse_notice,
)
from celery_baton.core.conditions import Condition, NotCancelled
from celery_baton.core.gate_channel import GateChannel
from celery_baton.core.policy.headers import PUBLISH_HEADER, stamp_time
from celery_baton.core.shared_cancels import SharedCancels
from celery_baton.errors import BatonError
from celery_baton.worker.pool.cancel_start import CancelledAtStart

logger = logging.getLogger("celery_baton.worker")

#: Set on a unique request this worker holds for later (its countdown or ETA) and marked
#: under its id (:meth:`Cancelling.hold_for_later`): its start takes the mark back.
HELD_FOR_LATER_ATTR = "_baton_held_for_later"
#: Seconds a held-for-later mark outlives the task's time (Celery's timer may hand it on
#: late on a busy loop); a mark outliving its start is taken back there.
HELD_MARGIN = 60.0


def revoke(request: Any, why: str) -> None:
    """Revoke ``request`` as Celery's own ``revoke`` does when the request reaches it."""
    logger.info("%s[%s] cancelled (%s)", request.name, request.id, why)
    worker_state.revoked.add(request.id)
    request.revoked()


def exception_of(exc_info: Any) -> BaseException | None:
    """The exception of a failed trace's ``ExceptionInfo``."""
    exc = getattr(exc_info, "exception", None)
    return getattr(exc, "exc", exc)  # Celery's ExceptionWithTraceback wraps it


#: Set on the ``on_failure`` that :func:`revoke_refused_starts` put on a request class.
_REVOKES_ATTR = "_baton_revokes_refused_starts"


def revoke_refused_starts(request_class: type) -> None:
    """Make every request of ``request_class`` (Celery's ``Request``, which each task's
    request class extends) revoke itself when the start of its job refused it: the
    trace raised ``CancelledAtStart``, an ``Ignore`` Celery would only acknowledge. It is
    revoked as Celery revokes: ``REVOKED``, the ``task-revoked`` event (not terminated),
    acknowledged, the ``task_revoked`` signal. Whatever found the cancel (this worker's
    notice, its match by key, or the store, asked where the job started because the
    worker had not heard its notices lately), the start refused a call that was
    cancelled. Any other failure goes to Celery's own handler. Once per class."""
    celery_on_failure = request_class.on_failure  # type: ignore[attr-defined]
    if getattr(celery_on_failure, _REVOKES_ATTR, False):
        return

    def on_failure(
        self: Any, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False
    ) -> Any:
        exc = exception_of(exc_info)
        if isinstance(exc, CancelledAtStart):
            revoke(self, f"{exc.why}, while it waited for its pool")
            return None
        return celery_on_failure(self, exc_info, send_failed_event, return_ok)

    setattr(on_failure, _REVOKES_ATTR, True)
    request_class.on_failure = on_failure  # type: ignore[attr-defined]


def _held_requests() -> list[Any]:
    """The requests this worker holds: received and not ended (waiting for a pool
    process, in its pool's queue, held by admission, running). ``list`` of a dict's
    values is taken at once (no other thread runs meanwhile)."""
    return list(worker_state.requests.values())


class Cancelling:
    """The worker's screen of cancelled deliveries (see the module docstring)."""

    def __init__(
        self,
        cancels: Cancels,
        channel: GateChannel,
        *,
        keep_noticed: float,
        generation: Callable[[], int],
        in_gate: bool,
        noticed: SharedCancels | None = None,
    ) -> None:
        self.cancels = cancels
        #: Where the ids noticed cancelled are told to whatever starts a job (a plain
        #: job waiting for a pool process is asked again there: core/shared_cancels.py).
        self.noticed = noticed
        #: A delivery that asks the gate is checked in that very call (NotCancelled):
        #: on one server; on Redis Cluster the id's record is on a slot of its own.
        self.in_gate = in_gate
        self.channel = channel
        self.watch = CancelWatch(cancels, keep_noticed=keep_noticed)
        self.generation = generation
        self._refreshed = 0.0
        self.revoked = 0
        #: Told the ids of the calls a notice cancels that this worker holds (the
        #: listener's thread): their unique keys are freed at once where they have not
        #: started (worker/revoked_first.py), not when their turn discards them.
        self.on_cancelled: Callable[[list[str]], None] | None = None

    # -- learning (other threads) -------------------------------------------------------

    def refresh(self) -> bool:
        """Read the marker now (at start; on the lease book's heartbeat, every REFRESH).
        False when the store did not answer."""
        return self._read_store(self._read_marker)

    def caught_up(self) -> bool:
        """The notice listener (re)subscribed: the notices sent while it was not never
        come, so what they said is read from the store (the listener's thread): the
        marker and the key cancels that changed (matched against the calls held here),
        and, while cancels by id live, each held call's id. False when the store did
        not answer (the listener asks again; meanwhile jobs ask where they start)."""
        return self._read_store(self._read_marker, self._read_held_ids)

    def _read_store(self, *reads: Callable[[], None]) -> bool:
        """Run ``reads`` (on another thread than the consumer's: never raise there)."""
        self._refreshed = time.monotonic()
        try:
            for read in reads:
                read()
        except BatonError as exc:
            logger.debug("baton: could not read the cancels (%s)", exc)
            return False
        except Exception:
            logger.exception("baton: reading the cancels failed")
            return False
        return True

    def _read_marker(self) -> None:
        for task in self.watch.refresh():  # a task's key cancels read anew
            self.mark_held(task)

    def _read_held_ids(self) -> None:
        if self.noticed is None or not self.watch.ids_live():
            return
        for request in _held_requests():
            if self.cancels.is_cancelled(request.id):
                logger.debug("baton: %s[%s] held here is cancelled", request.name, request.id)
                self.noticed.add(request.id)

    def heartbeat(self) -> None:
        if time.monotonic() - self._refreshed >= REFRESH:
            self.refresh()

    def notice(self, text: str) -> bool:
        """A notice from the notice channel: True when it was a cancel (taken here)."""
        notice = parse_notice(self.cancels.names.cancels, text)
        if notice is None:
            return False
        logger.debug("baton: cancel notice %s %s%s", notice.kind, notice.task_id, notice.task)
        # First: a delivery screened from now on knows of it; one screened before is
        # held here already (Celery reserves a request before it is screened).
        self.watch.notice(notice)
        if notice.kind == ID_FIELD and notice.task_id and self.noticed is not None:
            self.noticed.add(notice.task_id)
            if self.on_cancelled is not None and notice.task_id in worker_state.requests:
                self.on_cancelled([notice.task_id])
        elif notice.cancel is not None:
            self.mark_held(notice.task, notice.cancel)
        return True

    def mark_held(self, task: str, cancel: KeyCancel | None = None) -> None:
        """The calls of ``task`` this worker holds that ``cancel`` (None: any of its
        key cancels) covers (a call waiting for a pool process was screened before the
        cancel existed): each is written where its job's start reads it, with until when
        its cancel lives, and revokes itself when refused there. Once per cancel
        learned, over the calls held (bounded by the prefetch and the holds): nothing is
        added to a call's start."""
        if self.noticed is None or not self.watch.has_key_cancels(task):
            return
        cancelled = []
        for request in _held_requests():
            if request.name != task or request.id in worker_state.revoked:
                continue
            covering = self._key_cancel(request, only=cancel)
            if covering is None:
                continue
            until = self.watch.key_cancel_end(task, covering)
            self.noticed.add(request.id, until=until)
            cancelled.append(request.id)
            logger.debug(
                "%s[%s] held here is cancelled by key %s: refused where it starts",
                request.name,
                request.id,
                covering.material,
            )
        if cancelled and self.on_cancelled is not None:
            self.on_cancelled(cancelled)

    # -- screening (the consumer's loop) ------------------------------------------------

    def known(self, request: Any) -> str | None:
        """Why ``request`` is cancelled by what this worker knows already, or None."""
        if self.watch.noticed(request.id):
            return "cancelled by id"
        if not self.watch.has_key_cancels(request.name):  # every delivery: keep it cheap
            return None
        cancel = self._key_cancel(request)
        if cancel is not None:
            return f"cancelled by key {cancel.material}"
        return None

    def _key_cancel(self, request: Any, only: KeyCancel | None = None) -> KeyCancel | None:
        """The live key cancel of its task (or ``only``) that covers ``request``, or None."""
        return self.watch.key_cancelled(
            request.name,
            getattr(request.task, "run", None),
            request.args or (),
            request.kwargs or {},
            stamp_time(request.request_dict.get(PUBLISH_HEADER)),
            only=only,
        )

    def screen(self, request: Any, admit: Callable[[Any], Any]) -> Any:
        """For a delivery that asks the gate nothing (what :meth:`known` says was asked
        already): revoke ``request`` when the store says it is cancelled by id, else
        ``admit`` it (at once while no cancel by id lives, or when the store answered)."""
        if not self.watch.ids_live():
            logger.debug(
                "%s[%s] admitted unchecked (no cancel by id lives)", request.name, request.id
            )
            return admit(request)
        return self._admit_unless_cancelled(request, self.cancels.check_call(request.id), admit)

    def _admit_unless_cancelled(
        self, request: Any, call: tuple[str, list[str], list[Any]], admit: Callable[[Any], Any]
    ) -> None:
        """Send ``call`` (a script that replies 1 when ``request``'s id is cancelled) on
        the gate channel: revoke ``request`` when it says so, else ``admit`` it (also when
        the store did not answer: a gate ask meets the store's trouble)."""
        script, keys, args = call
        generation = self.generation()

        def answered(reply: Any) -> None:
            # On the loop; kombu swallows exceptions there: none may escape.
            try:
                if generation != self.generation():
                    return  # the connection was lost meanwhile: the broker redelivers it
                if isinstance(reply, BaseException):
                    logger.warning(
                        "baton: could not check whether %s[%s] is cancelled (%s); admitting it",
                        request.name,
                        request.id,
                        reply,
                    )
                elif int(reply):
                    self._revoke(request, "cancelled by id")
                    return
                admit(request)
            except Exception:
                logger.exception("baton: screening %s[%s] failed", request.name, request.id)

        self.channel.run(script, keys, args, answered)

    # -- a unique task held for later (its countdown or ETA) ------------------------------

    def hold_for_later(self, request: Any, unique_key: str, delay: float) -> None:
        """``request``, a unique task, waits in this worker ``delay`` seconds for its time
        (Celery's timer): marked under its id with the key it holds, so that
        ``baton.cancel`` of its id frees that key before it marks it REVOKED (the caller
        knows only the id). Sent on the gate channel, in order before its start's
        :meth:`start_held`."""
        request.__dict__[HELD_FOR_LATER_ATTR] = True
        script, keys, args = self.cancels.held_call(request.id, unique_key, delay + HELD_MARGIN)

        def answered(reply: Any) -> None:
            if isinstance(reply, BaseException):
                logger.warning(
                    "baton: %s[%s] waits for its time; a cancel of it frees its unique key "
                    "only when it is discarded then (the store did not answer: %s)",
                    request.name,
                    request.id,
                    reply,
                )

        self.channel.run(script, keys, args, answered)

    def start_held(self, request: Any, admit: Callable[[Any], Any]) -> Any:
        """``request``'s time came: the mark :meth:`hold_for_later` wrote is taken back
        and, in the same step, the store says whether its id is cancelled (a cancel that
        read the mark freed its key: it must not start). Revoked when cancelled, else
        ``admit``-ted."""
        del request.__dict__[HELD_FOR_LATER_ATTR]
        self._admit_unless_cancelled(request, self.cancels.start_call(request.id), admit)
        return None

    def with_check(self, request: Any, conditions: list[Condition]) -> list[Condition]:
        """``conditions`` with the check of ``request``'s id first, while cancels by id
        live (asked first: a cancelled delivery writes nothing, spends nothing)."""
        if not self.watch.ids_live():
            return conditions
        return [NotCancelled(self.cancels.names.cancel_id(request.id), request.id), *conditions]

    def check(self, request: Any, answer: Callable[[bool | BaseException], None]) -> None:
        """Ask the store whether ``request`` is cancelled by id: ``answer`` gets True,
        False or the error (a held delivery's next turn, while cancels by id live)."""
        script, keys, args = self.cancels.check_call(request.id)

        def answered(reply: Any) -> None:
            answer(reply if isinstance(reply, BaseException) else bool(int(reply)))

        self.channel.run(script, keys, args, answered)

    def revoke(self, request: Any, why: str) -> None:
        self._revoke(request, why)

    def _revoke(self, request: Any, why: str) -> None:
        self.revoked += 1
        revoke(request, why)
