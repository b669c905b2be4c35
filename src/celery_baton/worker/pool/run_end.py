"""A run's end, recorded by the process that ran it, before anyone can see it ended.

The main process records a run's end when Celery tells it the job is over
(``worker/request.py``), after Celery acked the message. Two things happen before that:

* the result is stored, in the pool process: a caller waiting on it sees the run
  end, and a publish it makes next must be a new run, not deduplicated into the
  finished task (the unique claim was freed after the result: 16-27 % of such
  publishes got the old id);
* the pool process reports back, and the main process may die before it acks:
  killed, or its consumer lost on an unrecoverable error (Celery 5.7 and kombu can
  die that way on a broker restart). The message comes back, and without a record
  of the run the redelivery guard would run it a second time.

So the process that ran the task records the end itself: right before the result is
stored (``backend.store_result`` of its own task id with a final state), or, when no
result is stored (``ignore_result``, ``Ignore``, ``Reject``), in ``task_postrun``,
before it reports back. What it records is what the main process would record later,
decided the way Celery decides it:

* ``SUCCESS``, ``FAILURE``, ``Ignore`` (``Task.replace``), ``Reject(requeue=False)``
  and ``Reject`` of a message acked at the start: Celery is done with the message.
  The done marker (a copy is acked without running) and the unique claim freed.
* ``Retry`` (``Task.retry``, ``autoretry_for``): the same task id was sent again, as
  the next attempt. Under the guard, this attempt is recorded (its stamp and retries,
  ``attempt_stamp``): a copy of its message is refused, the retry runs. The unique
  claim stays: the retry owns it.
* ``Reject(requeue=True)`` of an ``acks_late`` message: it comes back to run again.
  Nothing.

A pool process that dies inside the task records nothing: its run did not end (the
main process judges it: time limit, ``WorkerLostError``, revoke).

The run's leases (exclusive key, concurrency slots) are freed here too, whatever the
end: the main process hears of an end on its consumer's event loop, which does not turn
while the consumer reconnects to the broker (seconds after a broker restart, or as long
as the broker stays away), and its lease renewer, a thread of its own, went on renewing
them: a duplicate on another worker was skipped as held by a run that had ended. The
renewals still on their way must read "ended", not "lost": the renewer asks the shared
memory below.

The process says what it did in memory the worker's main process reads
(``core/shared_ends.py``: ending, then recorded once the store answered). The main
process records the same again when it learns of the end only when that record is
missing (the store did not answer, or the process died sending it): idempotent, every
release compares its owner, so a claim a new publish took meanwhile stays. Its lease
renewer takes a lease gone under a run that is ending for that run's release, not a
loss. (Workers of the previous version marked each freed lease ended in the store
instead, ``Release.ended_mark``: release.lua and renew.lua still read those marks.)
Without a pool (solo, threads, gevent) the task
runs in a thread of the main process: its end is recorded here all the same, before the
result.

An ordered call's end (``ordered=``) moves its key's line the same way, from here: a
final end gives the next position its turn, a retry keeps the place until the retry is
due (worker/ordering.py). So a worker killed between the end and its ack does not run
the call again: its copy finds its position passed, and is acked without running.

Without the redelivery guard an ``acks_late`` copy of a run whose worker died after
the result was stored runs again (Celery's at-least-once): its claim was freed, so a
publish made after the result may run beside it. The guard refuses that copy.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from celery import current_task, signals, states

from celery_baton.core.conditions import attempt_stamp
from celery_baton.core.gate import Release
from celery_baton.core.policy.model import RunPlan, TaskPolicy
from celery_baton.core.shared_ends import ENDING, RECORDED, SharedEnds
from celery_baton.parts import parts_for
from celery_baton.worker import ordering

logger = logging.getLogger("celery_baton.worker")

RUN_END_FIELD = "baton_run_end"
#: Set on a result backend whose ``store_result`` records a run's end first.
_WRAPPED_ATTR = "_baton_records_run_ends"

#: What the worker's processes say of the ends they recorded (made by the main process
#: before its pool forks: ``share_ends``); None in a process that is no worker.
_shared: SharedEnds | None = None


def share_ends() -> SharedEnds:
    """Worker's main process, before the pool starts: the table its pool processes
    (forked from it, so sharing it) and its own runs write their recorded ends in."""
    global _shared
    if _shared is None:
        _shared = SharedEnds()
    return _shared


#: The states Celery stores for a run that ended (a retry is an end of its attempt).
_STORED_ENDS = frozenset({states.SUCCESS, states.FAILURE, states.RETRY})
#: The final states the worker's main process stores itself (``before_the_result``).
_FINAL_HERE = frozenset({states.FAILURE, states.REVOKED})


@dataclass(frozen=True, slots=True)
class RunEnd:
    """What a guarded or unique run records at its end (``mark``: in the request)."""

    owner: str
    done_key: str  # '': no redelivery guard
    retention: float
    unique_key: str  # '': none freed at the end
    stamp: str
    link: str
    attempt: int
    # ordered=: "<epoch> <position>" of the call, its key's order record and lease ('':
    # not an ordered call).
    place: str = ""
    order_key: str = ""
    order_lease: str = ""
    # The run's leases, freed at any end.
    lease_keys: tuple[str, ...] = ()

    def release(self, task_id: str, state: str, exc: Any, acks_late: bool) -> Release | None:
        """The record of an end in ``state`` (``exc``: what the body raised), or None."""
        return self.with_leases(self.of_the_end(task_id, state, exc, acks_late))

    def with_leases(self, release: Release | None) -> Release | None:
        """``release`` that also frees the run's leases (freed at any end)."""
        if not self.lease_keys:
            return release
        return dataclasses.replace(
            release or Release((), self.owner),
            lease_keys=tuple(self.lease_keys),
        )

    def of_the_end(self, task_id: str, state: str, exc: Any, acks_late: bool) -> Release | None:
        """What an end in ``state`` means for the message: its done marker, unique claim
        and place in its key's line (None: nothing this process can decide)."""
        if state == states.RETRY:
            retried = None
            if self.done_key and not self.link:  # (a beat slot's record is per slot)
                retried = Release(
                    (),
                    self.owner,
                    self.done_key,
                    self.retention,
                    done_stamp=attempt_stamp(self.stamp, self.attempt),
                )
            return self._ordered(retried, end="0", hold=ordering.retry_in(exc))
        if state == states.REJECTED and getattr(exc, "requeue", False) and acks_late:
            return None  # back to the broker, to run again
        if state not in (states.SUCCESS, states.FAILURE, states.IGNORED, states.REJECTED):
            return None
        ended = Release(
            (),
            self.owner,
            self.done_key or None,
            self.retention,
            self.unique_key or None,
            task_id,
            done_stamp=self.stamp,
            done_link=self.link,
        )
        # "3": final, its lease still held (its worker frees it, and wakes the next call);
        # "1" when the lease is freed here too, in the same call.
        return self._ordered(ended, end="1" if self.lease_keys else "3", hold=0.0)

    def _ordered(self, release: Release | None, *, end: str, hold: float) -> Release | None:
        """``release`` with the end of an ordered call (worker/ordering.py; release.lua
        says what ``end`` means)."""
        if not self.place:
            return release
        return dataclasses.replace(
            release or Release((), self.owner),
            order=f"{self.place} {end} {round(hold * 1000)}",
            order_key=self.order_key,
            order_lease=self.order_lease,
        )


def mark(request_dict: dict[str, Any], policy: TaskPolicy, plan: RunPlan) -> None:
    """Main process, as the run starts: what its end records, wherever it runs."""
    unique_key = policy.freed_at_end(plan)
    place = ordering.end_place(plan)
    if plan.done_key is None and unique_key is None and not place and not plan.leases:
        return
    request_dict[RUN_END_FIELD] = (
        plan.owner,
        plan.done_key or "",
        policy.redelivery_retention,
        unique_key or "",
        plan.done_stamp,
        plan.done_link,
        plan.done_attempt,
        place,
        plan.order_key or "",
        plan.exclusive_key or "",
        tuple(lease.key for lease in plan.leases),
    )


#: Set on a run's own request context (``task.request``, one per thread or greenlet)
#: while its end is not recorded yet: its RunEnd.
_ARMED_ATTR = "_baton_run_end"


def arm(sender: Any = None, task_id: str = "", task: Any = None, **_: Any) -> None:
    """``task_prerun``: a run whose end is to be recorded starts in this process.

    Kept on the run's own request context, not by task id: on the threads, gevent and
    eventlet pools two runs of one task id can share the process (a redelivered copy
    beside its first delivery), and a run that found the other's record by its id freed
    the other's leases as it ended (tests/pools/test_same_id_twice.py)."""
    if task is None or not task_id:
        return
    fields = getattr(task.request, RUN_END_FIELD, None)
    if not fields:
        return
    try:
        run_end = RunEnd(*fields)
    except TypeError:  # not what mark() wrote: never guess
        logger.error("baton: %s[%s]: unreadable %s %r", task.name, task_id, RUN_END_FIELD, fields)
        return
    setattr(task.request, _ARMED_ATTR, run_end)
    _record_before_the_result(task.backend)


#: The main process's requests whose end Celery is handling now, by task id: what to do
#: right before it stores their final state (``before_the_result``).
_before_the_result: dict[str, Callable[[], None]] = {}


@contextmanager
def before_the_result(backend: Any, task_id: str, first: Callable[[], None]) -> Iterator[None]:
    """Main process, around Celery's handling of a run's end there (``on_timeout``,
    ``on_failure``, a revoke before the start): ``first`` runs right before ``backend``
    stores the run's FAILURE or REVOKED, if it does. Celery stores it there when the
    process that ran the body could not (killed at its hard time limit, lost) or when no
    body ran, and a caller who sees it may publish again at once (worker/request.py)."""
    _record_before_the_result(backend)
    _before_the_result[task_id] = first
    try:
        yield
    finally:
        _before_the_result.pop(task_id, None)


def _record_before_the_result(backend: Any) -> None:
    """Make ``backend`` record a running task's end before it stores its final state."""
    if getattr(backend, _WRAPPED_ATTR, False):
        return
    store_result = backend.store_result

    def recording_store_result(task_id: Any, result: Any, state: Any, *a: Any, **kw: Any) -> Any:
        if state in _STORED_ENDS:
            # The run on this thread or greenlet, if it is the one whose state this is
            # (a body may store other tasks' results: a batch's calls).
            current = current_task._get_current_object() if current_task else None
            if current is not None:
                _record(current, task_id, state, result)
        if state in _FINAL_HERE and _before_the_result:
            first = _before_the_result.pop(task_id, None)
            if first is not None:
                first()
        return store_result(task_id, result, state, *a, **kw)

    backend.store_result = recording_store_result
    setattr(backend, _WRAPPED_ATTR, True)


def record_run_end(
    sender: Any = None,
    task_id: str = "",
    task: Any = None,
    state: str | None = None,
    retval: Any = None,
    **_: Any,
) -> None:
    """``task_postrun``: an end whose result was not stored, recorded before the pool
    process reports back."""
    if task is not None:
        _record(task, task_id, state or "", retval)


def _record(task: Any, task_id: str, state: str, exc: Any) -> None:
    """Record the end of ``task``'s run on this thread or greenlet, once, if it is armed
    and is the run of ``task_id``."""
    request = task.request
    run_end = getattr(request, _ARMED_ATTR, None)
    if run_end is None or getattr(request, "id", None) != task_id:
        return
    setattr(request, _ARMED_ATTR, None)
    end = run_end.of_the_end(task_id, state, exc, bool(task.acks_late))
    release = run_end.with_leases(end)
    if release is None:
        return
    shared = _shared
    if shared is not None:
        shared.set(run_end.owner, ENDING)
    try:
        parts_for(task.app).gate.release_many([release])
    except Exception as error:  # the main process records it too, when it learns of the end
        logger.warning("baton: %s[%s] ended; recording it failed: %s", task.name, task_id, error)
        return
    if shared is not None and (end is not None or state == states.RETRY):
        # Only its leases freed (a run a green pool's time limit unwound ends in no
        # state Celery names): what the end means for its message, done marker and line
        # is the main process's to record. ENDING keeps its lease renewer from taking
        # the freed leases for lost meanwhile.
        shared.set(run_end.owner, RECORDED)


def final_end(
    task_id: str, policy: TaskPolicy, plan: RunPlan, leases: tuple[str, ...] = ()
) -> Release:
    """What a final end of ``plan``'s run means for its message: its done marker (under
    the redelivery guard) and its unique claim freed, with ``leases`` (by default none:
    they are the run's, freed with its release)."""
    return Release(
        leases,
        plan.owner,
        plan.done_key or None,
        policy.redelivery_retention,
        policy.freed_at_end(plan),
        task_id,
        done_stamp=plan.done_stamp,
        done_link=plan.done_link,
    )


def ending(owner: str) -> None:
    """Main process: the run of ``owner`` is ending here, its leases freed before its
    release (a lost pool process's run): its lease renewer reads them gone as that."""
    if _shared is not None:
        _shared.set(owner, ENDING)


def record_end_now(app: Any, release: Release) -> None:
    """Record ``release`` now, waiting for the store (idempotent: the run's release later
    records the same; a claim a new publish took meanwhile stays, the release compares
    its owner). A store that does not answer is logged: the run's release records it
    later."""
    try:
        parts_for(app).gate.release_many([release])
    except Exception as error:
        logger.warning(
            "baton: [%s] ended; recording it before its result failed: %s",
            release.unique_owner,
            error,
        )


def install() -> None:
    signals.task_prerun.connect(arm, weak=False, dispatch_uid="baton-run-end-arm")
    signals.task_postrun.connect(record_run_end, weak=False, dispatch_uid="baton-run-end")
