"""Releasing: whatever the gate granted is given back, through one transport.

A run gives back its leases when it ends, whichever way (``worker/request.py`` calls
:meth:`Releasing.finish` from Celery's own completion paths); when its end is final it
also marks its task id done (redelivery guard) and frees its unique key, unless its ack
failed: then the message comes back, and the key is kept for that copy (for
``redelivery_window``, which the copy's admission extends to ``unique_ttl``), unless
the broker shows that the ack ran after all (``worker/transport/ack_fate.py``). A delivery
that will not run here gives back what the gate *may* have granted it: an ask whose
answer was lost (the store may still execute it), or a delivery forgotten when the
broker connection dropped. Every release compares the owner, so giving back what was
never granted frees nothing of anyone else's.

None of this waits on the consumer's loop. A release the store did not answer is sent
again once the store answers (``worker/unsent.py``), never ahead of a call the store
had buffered, which is what makes the give-back of a lost ask safe.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from typing import Any

from celery_baton.core.conditions import attempt_stamp
from celery_baton.core.gate import Release
from celery_baton.core.gate_channel import GateChannel
from celery_baton.core.leases import LeaseBook
from celery_baton.core.policy.model import RunPlan, TaskPolicy
from celery_baton.core.recorded_ends import RecordedEnds
from celery_baton.core.shared_ends import SharedEnds
from celery_baton.worker import ordering
from celery_baton.worker.loop_door import LoopDoor
from celery_baton.worker.request import detach, reached_the_pool, retried
from celery_baton.worker.transport.ack_fate import AckFates
from celery_baton.worker.transport.broker_writes import BrokerWrites
from celery_baton.worker.unsent import UnsentReleases

logger = logging.getLogger("celery_baton.worker")

GONE_POLL = 0.01  # seconds between looks at a terminated run's process or greenlet
#: Seconds a terminated run's leases are kept at most while its body still runs (a
#: process stuck in the kernel, or a pid taken again; a greenlet that ignores its exit):
#: then released, logged. The fence of the next holder still guards against the late run.
GONE_WAIT_MAX = 10.0


class Releasing:
    """The Finisher of every admitted run, and the give-back of every lost grant.

    Built before the gate channel it sends through: :meth:`attach` completes it.
    """

    def __init__(
        self,
        book: LeaseBook,
        timer: Any,
        unsent: UnsentReleases,
        *,
        hub: Any = None,
        redelivery_window: float | None = None,
        ack_fates: AckFates | None = None,
        broker_writes: BrokerWrites | None = None,
        recorded: RecordedEnds | None = None,
        shared_ends: SharedEnds | None = None,
    ) -> None:
        self.book = book
        #: The ends the runs' own processes recorded (worker/pool/run_end.py): not sent
        #: again.
        self.shared_ends = shared_ends
        #: The ends recorded lately, written again on a new master (replicated stores).
        self.recorded = recorded
        self.timer = timer
        self.hub = hub  # the consumer's event loop (None: solo and threads pools)
        #: Seconds within which the broker delivers an unacked message again (None: not
        #: known, e.g. AMQP, where it comes back when the broker sees the channel close).
        self.redelivery_window = redelivery_window
        #: Asks the broker whether a failed ack ran after all (the kept claim then goes).
        self.ack_fates = ack_fates or AckFates()
        #: Sends the acks without waiting for their replies (None: kombu's own acks).
        self.broker_writes = broker_writes
        self.unsent = unsent  # releases waiting for the store to answer again
        self.channel: GateChannel
        # Admitted requests handed to Celery whose run has not ended (drop_unstarted).
        self._handed: set[Any] = set()
        #: A run's end reported on another thread (the threads pool) is handled on the loop.
        self.door = LoopDoor()
        #: The second hops of after_ack not run yet (run at shutdown if the loop stopped).
        self._after_ack: dict[Callable[[], None], None] = {}
        #: Terminated runs waiting for their body's end: each next check -> its timer
        #: entry (armed again at a consumer restart: Celery 5.3 clears the timer).
        self._gone_checks: dict[Callable[[], None], Any] = {}

    def attach(self, channel: GateChannel) -> None:
        self.channel = channel

    # -- what is given back -------------------------------------------------------------

    def finish(
        self,
        request: Any,
        policy: TaskPolicy,
        plan: RunPlan,
        *,
        final: bool,
        unacked: bool = False,
    ) -> None:
        """Give back a run's leases; when final, mark its id done and free its unique key.

        ``unacked``: the run ended but its ack failed, so its message comes back: the id
        is done (the guard skips the copy) and the unique key freed; without the guard the
        copy runs again, and the key is kept for it, for :meth:`unacked_claim_ttl` s."""
        self._handed.discard(request)
        self.book.remove(plan.owner)
        done_key = plan.done_key if final else None
        done_stamp = plan.done_stamp
        if not final and plan.done_key and not plan.done_link and retried(request):
            # The attempt retried: a copy of its message must not run; its retry (the
            # same stamp, one attempt later) does (worker/pool/run_end.py did the same).
            done_key = plan.done_key
            done_stamp = attempt_stamp(plan.done_stamp, plan.done_attempt)
        unique_key = policy.freed_at_end(plan) if final else None
        # Under the guard the copy will not run (its id is done): nothing to keep it for.
        keep = self.unacked_claim_ttl(policy) if unique_key and unacked and not done_key else 0.0
        if unacked:
            logger.warning(
                "baton: %s[%s] ended but its ack failed: the broker delivers it again%s",
                request.name,
                request.id,
                f"; its unique key is kept for that copy ({keep:.0f}s)" if keep else "",
            )
        if not (plan.leases or done_key or unique_key):
            return
        release = Release(
            tuple(lease.key for lease in plan.leases),
            plan.owner,
            done_key,
            policy.redelivery_retention,
            unique_key,
            request.id,
            keep,
            done_stamp,
            plan.done_link,
        )
        if done_key and self.recorded is not None:
            self.recorded.keep(release)
        if (
            (final or retried(request))
            and not unacked
            and self.shared_ends is not None
            and self.shared_ends.recorded(plan.owner)
        ):
            # Its process recorded this end already, decided the same way (a final end
            # or a retry): sending it again would cost a store call per run for nothing.
            # Only this process knows of a failed ack (the claim kept for the copy) and
            # of a message that comes back (an ordered call's gap clock restarted).
            return
        self.channel.release(ordering.with_end(release, request, plan, final=final))
        if keep and unique_key:
            # Asked once the keep is on its way: the free it may lead to goes out on the
            # same channel, after it (_free_unique_now).
            key, task_id = unique_key, request.id
            self.ack_fates.check(
                getattr(request, "message", None),
                task_id,
                keep,
                lambda: self._free_unique_now(key, task_id),
            )

    def on_loop(self, call: Callable[[], None]) -> None:
        """Run ``call`` on the consumer's loop thread (now, when this is it)."""
        self.door.run(call)

    def on_loop_thread(self) -> bool:
        return self.door.on_loop_thread()

    def after_ack(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the acks Celery queued on the loop so far were sent
        and answered.

        Celery queues an ack with ``hub.call_soon``, whose callbacks run in no given
        order within one turn of the loop; a callback queued from one of them runs in a
        later turn: so two hops come after the ack is sent, and then its reply
        (``BrokerWrites.when_answered``). Without a loop Celery acks at once."""
        hub = self.hub
        if hub is None:
            callback()
            return
        waiting = self._after_ack

        def guarded() -> None:
            try:
                callback()
            except Exception:  # the loop would only log it: never keep a key silently
                logger.exception("baton: finishing a run after its ack failed")

        def second_hop() -> None:
            if second_hop not in waiting:
                return  # run already, at shutdown (run_after_acks)
            del waiting[second_hop]
            if self.broker_writes is None:
                guarded()
            else:
                self.broker_writes.when_answered(guarded)

        waiting[second_hop] = None
        hub.call_soon(lambda: hub.call_soon(second_hop))

    def run_after_acks(self) -> None:
        """At shutdown, once the loop stopped turning: finish the runs that waited for
        their ack. kombu's hub runs its pending callbacks once as it closes (Celery's
        acks among them), but a second hop queued by one of them never runs: the runs
        that ended in a warm shutdown kept their keys until ``lease_ttl``
        (tests/pools/test_shutdown.py). From now on an ack is not waited for."""
        self.hub = None
        for hop in list(self._after_ack):
            hop()  # each takes itself out

    def unacked_claim_ttl(self, policy: TaskPolicy) -> float:
        """How long the unique claim of a run whose ack failed is kept for its copy: until
        the broker delivers it again (then the copy's admission extends it, and its end
        frees it), bounded by ``unique_ttl``. The ack may have reached the broker after
        all (it timed out after it was sent): then no copy comes, and the key is freed as
        soon as the broker shows it (``worker/transport/ack_fate.py``), else when this runs out."""
        if self.redelivery_window is None:
            return policy.unique_ttl
        return max(1.0, min(policy.unique_ttl, self.redelivery_window))

    def finish_when_ended(
        self,
        ended: Callable[[], bool],
        what: str,
        request: Any,
        policy: TaskPolicy,
        plan: RunPlan,
        *,
        final: bool,
        unacked: bool = False,
    ) -> Callable[[], None]:
        """:meth:`finish` a terminated run once ``ended()`` (its pool process is gone, its
        greenlet dead: ``worker/pool/job_end.py``): Celery announces the revoke right
        after asking the pool to stop it, while the body may still run; until it ended
        the run keeps its leases (and the lease book renews them). ``what`` ran it (for
        the log). Returns the call that finishes it at once (the job's end was reported:
        the body unwound, or survived the stop and returned)."""
        deadline = time.monotonic() + GONE_WAIT_MAX
        pending = [True]

        def end_now() -> None:
            if pending:
                pending.clear()
                self.finish(request, policy, plan, final=final, unacked=unacked)

        def check() -> None:
            self._gone_checks.pop(check, None)
            if not pending:
                return
            try:
                if ended():
                    end_now()
                elif time.monotonic() > deadline:
                    logger.warning(
                        "baton: %s[%s] was terminated but %s still runs after %.0fs; "
                        "releasing its keys",
                        request.name,
                        request.id,
                        what,
                        GONE_WAIT_MAX,
                    )
                    end_now()
                else:
                    self._gone_checks[check] = self.timer.call_after(GONE_POLL, check, priority=5)
            except Exception:  # kombu's timer swallows exceptions: never keep a key
                logger.exception("baton: releasing terminated %s failed", request.id)
                end_now()

        check()
        return end_now

    def handed(self, request: Any) -> None:
        """``request`` was admitted and handed to Celery (its pool, or the semaphore in
        front of it): tracked until its run ends."""
        self._handed.add(request)

    def revoked(self, task_id: str, *, terminated: bool) -> None:
        """Celery's ``task_revoked`` signal for ``task_id``: end its admitted run, when
        Celery's Request has no ``_announce_revoked`` to end it (``internals``)."""
        for request in tuple(self._handed):
            if request.id == task_id:
                request._baton_finish(terminated=terminated)

    def drop_unstarted(self, running: Collection[Any]) -> int:
        """The broker connection was lost, and Celery dropped every request it had not
        started (``Consumer.on_close``: the semaphore's queue, the pool's unsent jobs;
        their messages come back from the broker) without calling any of them again.
        Give back what they were granted: kept, their leases were renewed for the
        worker's life, and every later run of their keys waited for ever. ``running``:
        the requests a pool process accepted (Celery keeps those)."""
        dropped = 0
        for request in tuple(self._handed):
            if request in running:
                continue
            self._handed.discard(request)
            run = detach(request)
            if run is None:  # ended meanwhile
                continue
            dropped += 1
            plan = run[2]
            if reached_the_pool(request):
                # Perhaps already written to a pool process, which may run it after all
                # (Celery no longer listens for it): its leases lapse within lease_ttl
                # instead of being freed under a run that may start.
                self.book.remove(plan.owner)
            else:
                self.give_back(plan)
        return dropped

    def give_back(self, plan: RunPlan, *, done_ttl: float = 0.0) -> None:
        """Free what the gate granted ``plan``'s owner, who will not run with it; with
        ``done_ttl``, its id is also marked done for that long (the guard skips a copy)."""
        self.book.remove(plan.owner)
        done_key = plan.done_key if done_ttl > 0 else None
        if plan.leases or done_key:
            lease_keys = tuple(lease.key for lease in plan.leases)
            release = Release(lease_keys, plan.owner, done_key, done_ttl, done_link=plan.done_link)
            self.channel.release(release)
            if done_key and self.recorded is not None:
                self.recorded.keep(release)

    def give_back_lost(self, plan: RunPlan) -> None:
        """``plan``'s ask got no answer, but the store may still execute it and grant its
        leases to this owner, who will never run with them: release them once the store
        answers again, so that the release arrives after the lost call (harmless if
        nothing was granted). The caller asks again, if at all, as a new owner."""
        if plan.leases:
            self.unsent.add(Release(tuple(lease.key for lease in plan.leases), plan.owner))

    def free_unique(self, key: str, task_id: str) -> None:
        """Free a unique claim if ``task_id`` still holds it (a skipped or revoked run),
        sent like a release: the consumer's loop never waits for it."""
        self.channel.release(Release.unique_claim(key, task_id))

    def _free_unique_now(self, key: str, task_id: str) -> None:
        """Off the loop (the ack fates' thread): free a claim kept for a copy that will
        not come. Sent through the loop's channel, after the release that kept it: sent
        from this thread straight to the store, it could land first (the broker answered
        within milliseconds), free nothing, and the keep then took the claim again for
        its whole time (the soak's publishes deduplicated into a run 35 s over)."""
        release = Release.unique_claim(key, task_id)
        self.on_loop(lambda: self.channel.release(release))

    def restart(self, timer: Any) -> None:
        """The consumer restarted (a lost broker connection): its timers were reset."""
        self.timer = timer
        self.unsent.restart(timer)
        # A terminated run's next check went with a cleared timer (Celery 5.3): its
        # leases, renewed meanwhile, were kept for good. Checked again now.
        checks, self._gone_checks = self._gone_checks, {}
        for check, entry in checks.items():
            entry.cancel()  # a timer that was kept (Celery 5.6+): not twice
            check()
