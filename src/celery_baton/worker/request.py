"""Release on every completion path, in the worker's main process.

An admitted request's class is swapped for a subclass of its own class (Celery builds
one per task in its strategy) that lets Celery do what it always does, then gives back
what the gate granted. Every terminal path of a request passes through one of these
methods in the main process: success, failure (including retry, Reject, time limits
and ``WorkerLostError`` when a pool child is killed), hard timeout, revoke (also with
``terminate=True``) and cancel. The run is given back once, by the first of them to
end (some paths run two: a hard time limit, then the failure; a failed result handed
to ``on_success``, which calls ``on_failure``).

A run *terminated* by a revoke (``revoke(terminate=True)``, and every replaced run of
``exclusive_conflict="replace"``) or cancelled (a lost broker connection with
``worker_cancel_long_running_tasks_on_connection_loss``) is announced by Celery as soon
as it asked the pool to stop it, while the body may still run: it is given back only
once the body has ended (its pool process gone, its greenlet dead:
``worker/pool/job_end.py``, ``Releasing.finish_when_ended``), or once Celery reports the
job's end after all (a greenlet that unwound, a run that survived the signal and
returned), so the next holder of its key never overlaps it.

Whether the delivery is over for good (``final``: mark its task id done, free its
unique key) is read from what Celery did with the message on that path, never guessed
from the exception. The request records Celery's decisions as they are made:

* ``reject(requeue=True)`` of a message not yet acknowledged: it comes back;
* ``on_retry`` (``task.retry()`` or ``autoretry_for``) and a successful
  ``_retry_worker_lost`` (``retry_on_worker_lost``): the same task id was published
  again;

and when the path ends, a delivery is final when its message was acknowledged (acked,
or rejected without requeue; with ``acks_late=False`` that happened when the pool
accepted it) and neither of the above happened. A message nobody acknowledged is still
the broker's and comes back (a cancel after a lost connection): not final.

Celery's ``acknowledged`` says that Celery *tried*: when the broker does not answer the
ack (or reject), kombu logs "Couldn't ack" and Celery marks the request acknowledged
anyway. kombu's own ``Message.acknowledged`` is set only once the broker call returned.
A run whose message Celery acknowledged but kombu did not (``unacked``) did end (its id
is done for the redelivery guard), yet its message is still the broker's and comes back:
its unique key is kept for that copy (``Releasing.finish``), not freed. With an event
loop, Celery's ack is not sent in ``acknowledge()`` but queued on the loop: a run whose
ack is still to be sent is finished once the loop has sent it (``Finisher.after_ack``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from billiard.exceptions import WorkerLostError
from celery.exceptions import TaskRevokedError, TimeLimitExceeded

from celery_baton.core.gate import Release
from celery_baton.errors import BatonError
from celery_baton.parts import AppParts, parts_for
from celery_baton.worker import events
from celery_baton.worker.cancelling import exception_of, revoke
from celery_baton.worker.ordering import RETRY_IN_ATTR, retry_in
from celery_baton.worker.pool.cancel_start import CancelledBeforeStart
from celery_baton.worker.pool.job_end import forget_job, keep_job, run_ended
from celery_baton.worker.pool.run_end import (
    before_the_result,
    ending,
    final_end,
    record_end_now,
)
from celery_baton.worker.pool.stand_ins import STANDS_FOR_FIELD, after_lost_run
from celery_baton.worker.replacing import superseded_by
from celery_baton.worker.transport.broker_writes import unconfirmed

if TYPE_CHECKING:
    from celery_baton.core.policy.model import RunPlan, TaskPolicy

RUN_ATTR = "_baton_run"
POOLED_ATTR = "_baton_pooled"  # handed to the pool (not only to Celery's semaphore)
COMES_BACK_ATTR = "_baton_comes_back"  # why this task id will be delivered again
SUPERSEDED_ATTR = "_baton_superseded"  # its result is TaskSuperseded: Celery keeps it
ENDED_ATTR = "_baton_ended"  # a terminated run's release, due when its job ends after all
FINISHER_ATTR = "_baton_finisher"  # kept after the run ended: a late path reaches the loop


class Finisher(Protocol):
    def finish(
        self, request: Any, policy: TaskPolicy, plan: RunPlan, *, final: bool, unacked: bool
    ) -> None: ...

    def finish_when_ended(
        self,
        ended: Callable[[], bool],
        what: str,
        request: Any,
        policy: TaskPolicy,
        plan: RunPlan,
        *,
        final: bool,
        unacked: bool,
    ) -> Callable[[], None]: ...

    def after_ack(self, callback: Callable[[], None]) -> None: ...

    def on_loop(self, call: Callable[[], None]) -> None: ...

    def on_loop_thread(self) -> bool: ...


class BatonRequestMixin:
    """Mixed in front of a request's class once the gate admitted it."""

    __slots__ = ()

    # -- what Celery decided about the message ----------------------------------------

    def _baton_comes_back(self, why: str) -> None:
        self.__dict__[COMES_BACK_ATTR] = why

    def _baton_is_final(self) -> bool:
        """Whether Celery is done with this task id (False: it will be delivered again)."""
        if COMES_BACK_ATTR in self.__dict__:
            return False
        return bool(self.acknowledged)  # type: ignore[attr-defined]

    def _baton_unacked(self) -> bool:
        """Celery called the message acknowledged, but the broker did not confirm it: the
        ack (or reject) failed, only logged, and the message comes back; or, before
        ``after_ack``, the loop has not sent it yet, or its reply has not come
        (``worker/transport/broker_writes.py``)."""
        if not self.acknowledged:  # type: ignore[attr-defined]
            return False
        message = getattr(self, "message", None)
        if message is None or (message.acknowledged and not unconfirmed(message)):
            return False
        # A consumer without acks (none of Celery's own) acks nothing: nothing comes back.
        no_ack = getattr(getattr(message, "channel", None), "no_ack_consumers", None)
        return not (no_ack and (message.delivery_info or {}).get("consumer_tag") in no_ack)

    def reject(self, requeue: bool = False) -> Any:
        # Celery ignores a reject after the message was acknowledged (acks_late=False
        # acks when the pool accepts it): only a reject that reaches the broker requeues.
        if requeue and not self.acknowledged:  # type: ignore[attr-defined]
            self._baton_comes_back("requeued")
        return super().reject(requeue)  # type: ignore[misc]

    def on_retry(self, exc_info: Any) -> Any:
        # task.retry() published this task id again before it raised Retry.
        self._baton_comes_back("retried")
        # An ordered call keeps its place until its retry is due (worker/ordering.py).
        self.__dict__[RETRY_IN_ATTR] = retry_in(getattr(exc_info, "exception", None))
        return super().on_retry(exc_info)  # type: ignore[misc]

    def _retry_worker_lost(self, exc: Any, exc_info: Any) -> Any:
        # retry_on_worker_lost (Celery >= 5.7; never called before): False when the retry
        # could not be sent, and Celery goes on to fail or requeue the message as without
        # the option.
        retried = super()._retry_worker_lost(exc, exc_info)  # type: ignore[misc]
        if retried:
            self._baton_comes_back("retried")
        return retried

    def execute_using_pool(self, pool: Any, **kwargs: Any) -> Any:
        # Past Celery's semaphore: a connection loss no longer drops it unseen, except
        # from the pool's own queue (``Releasing.drop_unstarted``).
        self.__dict__[POOLED_ATTR] = True
        job = super().execute_using_pool(pool, **kwargs)  # type: ignore[misc]
        keep_job(self, pool, job)  # a green pool's greenlet: its end is the run's
        return job

    # -- where a path ends: give the run back -----------------------------------------

    def _baton_stood_for(self, exc: BaseException | None) -> None:
        """A debounced (or throttle-trailing) run ended where no postrun wrote its
        outcome to the publishes it stood for: written here (pool/stand_ins.py)."""
        if STANDS_FOR_FIELD in self.request_dict:  # type: ignore[attr-defined]
            after_lost_run(self, exc, final=self._baton_is_final())

    def _baton_finish(self, *, terminated: bool = False) -> None:
        finisher = self.__dict__.get(FINISHER_ATTR)
        if finisher is not None and not finisher.on_loop_thread():
            # assumes: a run's end is handled on the consumer's loop thread. The threads
            # pool calls on_success/on_failure from its own threads (tests/pools/test_threads.py).
            finisher.on_loop(lambda: self._baton_finish(terminated=terminated))
            return
        run = self.__dict__.pop(RUN_ATTR, None)
        if run is None:
            ended = self.__dict__.pop(ENDED_ATTR, None)
            if ended is not None:  # a terminated run's job ended (or its process died)
                ended()
            return
        finisher, policy, plan = run
        final = self._baton_is_final()
        # Only a unique claim waits for the ack: the done marker follows the run and the
        # leases are the run's, so both go at once (a consumer that dies before the loop
        # turns again must not take the done marker with it: its copy would run again).
        claim_at_stake = policy.freed_at_end(plan) is not None
        if not (final and claim_at_stake and self._baton_unacked()):
            # Whether a later ack fails matters to the unique claim alone: not read here
            # (before the loop sent it, every ack would look failed).
            self._baton_end(
                finisher, policy, plan, final=final, terminated=terminated, ack_read=False
            )
            return
        # Celery's ack may wait on the loop: decide once it was sent (or failed). A path
        # that ends the job meanwhile (a terminated run that returned after all) is kept.
        ended_early: list[bool] = []
        self.__dict__[ENDED_ATTR] = lambda: ended_early.append(True)

        def after_ack() -> None:
            if self.__dict__.get(ENDED_ATTR) is not None:
                self.__dict__.pop(ENDED_ATTR)
            self._baton_end(
                finisher,
                policy,
                plan,
                final=final,
                terminated=terminated and not ended_early,
                ack_read=True,
            )

        finisher.after_ack(after_ack)

    def _baton_end(
        self,
        finisher: Finisher,
        policy: TaskPolicy,
        plan: RunPlan,
        *,
        final: bool,
        terminated: bool,
        ack_read: bool,
    ) -> None:
        unacked = ack_read and final and self._baton_unacked()
        ended = run_ended(self) if terminated else None
        if ended is not None:  # the pool was asked to stop a body that may still run
            self.__dict__[ENDED_ATTR] = finisher.finish_when_ended(
                *ended, self, policy, plan, final=final, unacked=unacked
            )
        else:
            forget_job(self)
            finisher.finish(self, policy, plan, final=final, unacked=unacked)

    def on_success(self, failed__retval__runtime: Any, **kwargs: Any) -> Any:
        try:
            return super().on_success(failed__retval__runtime, **kwargs)  # type: ignore[misc]
        finally:
            self._baton_finish()

    def _baton_end_first(self, *, timing_out: bool = False, body_gone: bool = False) -> Any:
        """Around Celery's handling of an end in the main process: when it stores the
        run's FAILURE here (the process that ran the body could not: killed at its hard
        time limit, lost), what that end means for the message is recorded first,
        waiting for the store, as that process records it before its own result
        (worker/pool/run_end.py): the unique claim freed, so that a caller who sees the
        failure and publishes again gets a new run (freed after the result, 12 of 12 such
        publishes got the failed task back); under the redelivery guard the done
        marker, so that a copy of an ``acks_late`` message whose worker died before the
        ack is not run again. Only an end that is final: acknowledged by then and not
        coming back, or a hard time limit Celery then acks (``acks_late`` with its acks
        on a timeout, the default). A run whose body is gone (``body_gone``: its pool
        process died, ``WorkerLostError``) frees its leases here too, final or not:
        nothing runs under them any more (freed after the result, 12 of 12 exclusive
        keys were still held as the caller saw the failure). A prefork body past its hard
        time limit keeps its leases until its release (its process is killed after
        this; a green pool's run, unwound by its timeout, freed them as it ended:
        worker/pool/run_end.py). Celery's own write of the result is a round trip on
        this thread too. (A revoke before the start:
        ``_baton_revoked_first``.)"""
        run = self.__dict__.get(RUN_ATTR)
        if run is None:
            return contextlib.nullcontext()
        policy, plan = run[1], run[2]
        leases = tuple(lease.key for lease in plan.leases) if body_gone else ()
        if policy.freed_at_end(plan) is None and not plan.done_key and not leases:
            return contextlib.nullcontext()

        def first() -> None:
            if RUN_ATTR not in self.__dict__:
                return
            final = self._baton_is_final() or (timing_out and _acks_on_timeout(self.task))  # type: ignore[attr-defined]
            if final:
                release = final_end(self.id, policy, plan, leases)  # type: ignore[attr-defined]
            elif leases:
                release = Release(leases, plan.owner)
            else:
                return
            if leases:
                # Its renewer reads the lease gone as this run's own release, not a loss.
                ending(plan.owner)
            record_end_now(self.task.app, release)  # type: ignore[attr-defined]

        return before_the_result(self.task.backend, self.id, first)  # type: ignore[attr-defined]

    def _baton_revoked_first(self, terminated: bool) -> Any:
        """Around Celery's discard of an admitted task revoked (or expired) before its
        start: Celery stores its REVOKED, then acks the message, always: the end is
        final. What it means for the message is recorded first, waiting for the store,
        as for a FAILURE stored here (``_baton_end_first``): the unique claim freed, so
        that a caller who sees REVOKED and publishes again gets a new run; under the
        guard its done marker. (Freed after the ack before, a moment too short for
        tests/unique/test_after_the_result.py to catch. Celery 5.6 and later store
        REVOKED earlier, as the revoke is heard: worker/revoked_first.py.) A run
        terminated by a revoke keeps its key until its body has ended."""
        if terminated:
            return contextlib.nullcontext()
        release = revoked_release(self)
        if release is None:
            return contextlib.nullcontext()
        app = self.task.app  # type: ignore[attr-defined]
        return before_the_result(
            self.task.backend,  # type: ignore[attr-defined]
            self.id,  # type: ignore[attr-defined]
            lambda: record_end_now(app, release),
        )

    def on_failure(
        self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False
    ) -> Any:
        exc = exception_of(exc_info)
        if isinstance(exc, CancelledBeforeStart):
            # Cancelled while its job stood between the hand-over and its pool process
            # (worker/pool/cancel_start.py): its body never ran. Revoked as Celery revokes
            # (REVOKED, its event, acknowledged); _announce_revoked gives the run back.
            revoke(self, f"{getattr(exc, 'why', 'cancelled by id')}, before its late start")
            return None
        try:
            # Billiard >= 4.3 may report a lost process as SystemExit (Celery reads it so).
            lost = isinstance(exc, WorkerLostError | SystemExit | KeyboardInterrupt)
            with self._baton_end_first(body_gone=lost):
                return super().on_failure(exc_info, send_failed_event, return_ok)  # type: ignore[misc]
        finally:
            self._baton_stood_for(exc)
            self._baton_finish()

    def on_timeout(self, soft: bool, timeout: float) -> Any:
        if soft:  # a warning inside the task: the run goes on
            return super().on_timeout(soft, timeout)  # type: ignore[misc]
        try:
            with self._baton_end_first(timing_out=True):
                return super().on_timeout(soft, timeout)  # type: ignore[misc]
        finally:
            # gevent's pool ends a run past its limit here alone (no on_failure).
            self._baton_stood_for(TimeLimitExceeded(timeout))
            self._baton_finish()

    @property
    def store_errors(self) -> bool:
        if self.__dict__.get(SUPERSEDED_ATTR):
            return False  # its result is TaskSuperseded already (_announce_revoked)
        return bool(super().store_errors)  # type: ignore[misc]

    def _announce_revoked(self, *args: Any, **kwargs: Any) -> Any:
        # (reason, terminated, signum, expired)
        terminated = bool(args[1] if len(args) > 1 else kwargs.get("terminated"))
        # A replaced run: its replacing worker recorded TaskSuperseded naming the new
        # task; Celery would write its own TaskRevokedError over it.
        superseded = superseded_by(self) if super().store_errors else None  # type: ignore[misc]
        if superseded is not None:
            self.__dict__[SUPERSEDED_ATTR] = True
            run = self.__dict__.get(RUN_ATTR)
            events.run_superseded(self, superseded, run[2] if run is not None else None)
        try:
            with self._baton_revoked_first(terminated):
                return super()._announce_revoked(*args, **kwargs)  # type: ignore[misc]
        finally:
            # A debounced run revoked (held, or terminated mid-run): no postrun writes
            # its REVOKED to the publishes it stood for.
            self._baton_stood_for(TaskRevokedError())
            self._baton_finish(terminated=terminated)

    def _announce_cancelled(self, *args: Any, **kwargs: Any) -> Any:
        # Celery announces a cancel right after asking the pool to stop the run.
        try:
            return super()._announce_cancelled(*args, **kwargs)  # type: ignore[misc]
        finally:
            self._baton_finish(terminated=True)


def _acks_on_timeout(task: Any) -> bool:
    """Whether Celery acks an ``acks_late`` message whose run passed its hard time limit
    (``acks_on_timeout`` since Celery 5.7, ``acks_on_failure_or_timeout`` before)."""
    if not getattr(task, "acks_late", False):
        return True  # acked when its process accepted it
    flag = getattr(task, "acks_on_timeout", None)
    if flag is None:
        flag = getattr(task, "acks_on_failure_or_timeout", True)
    return bool(flag)


def revoked_release(request: Any) -> Release | None:
    """What a revoke of ``request`` before its start frees, recorded before Celery stores
    its REVOKED: an admitted run's final end, or, for a request not admitted (yet), its
    unique claim alone (nobody's leases; its ``task_revoked`` signal frees the same claim
    later, worker/step.py). None: nothing to free."""
    run = request.__dict__.get(RUN_ATTR)
    if run is not None:
        policy, plan = run[1], run[2]
        if policy.freed_at_end(plan) is None and not plan.done_key:
            return None
        return final_end(request.id, policy, plan)
    key = unique_key_of(parts_for(request.task.app), request)
    return None if key is None else Release.unique_claim(key, request.id)


def unique_key_of(parts: AppParts, request: Any) -> str | None:
    """The unique key ``request`` (a request of a ``unique`` task) holds; None for any
    other task, or when its key cannot be built (its admission, or the revoke signal's
    handler, says why)."""
    policy = parts.policy_for(request.task)
    if policy is None or policy.unique is None:
        return None
    try:
        return policy.unique_key(parts.names, request.args or (), request.kwargs or {})
    except BatonError:
        return None


_classes: dict[type, type] = {}


def attach(request: Any, finisher: Finisher, policy: TaskPolicy, plan: RunPlan) -> None:
    """Make ``request`` give back ``plan``'s leases when it ends, whichever way."""
    cls = type(request)
    if not issubclass(cls, BatonRequestMixin):
        sub = _classes.get(cls)
        if sub is None:
            sub = type(f"Baton{cls.__name__}", (BatonRequestMixin, cls), {"__slots__": ()})
            _classes[cls] = sub
        request.__class__ = sub
    request.__dict__[RUN_ATTR] = (finisher, policy, plan)
    request.__dict__[FINISHER_ATTR] = finisher
    request.__dict__.pop(COMES_BACK_ATTR, None)
    request.__dict__.pop(POOLED_ATTR, None)


def detach(request: Any) -> tuple[Any, Any, RunPlan] | None:
    """Take back what :func:`attach` gave ``request`` (None: its run already ended)."""
    run: tuple[Any, Any, RunPlan] | None = request.__dict__.pop(RUN_ATTR, None)
    return run


def retried(request: Any) -> bool:
    """Whether ``request``'s run ended in a retry (the same task id was sent again)."""
    return getattr(request, "__dict__", {}).get(COMES_BACK_ATTR) == "retried"


def reached_the_pool(request: Any) -> bool:
    return bool(request.__dict__.get(POOLED_ATTR))
