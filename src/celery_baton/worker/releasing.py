"""Releasing: whatever the gate granted is given back, through one transport.

A run gives back its leases when it ends, whichever way (``worker/request.py`` calls
:meth:`Releasing.finish` from Celery's own completion paths); when its end is final it
also marks its task id done (redelivery guard) and frees its unique key. A delivery
that will not run here gives back what the gate *may* have granted it: an ask whose
answer was lost (the store may have executed it), or a delivery forgotten when the
broker connection dropped. Every release compares the owner, so giving back what was
never granted frees nothing of anyone else's.

None of this waits on the consumer's loop: releases go through the gate channel
(pipelined, or a background thread), and a release the store did not confirm is
retried by the lease book until it is.
"""

from __future__ import annotations

from typing import Any

from celery_baton.gate import Release
from celery_baton.gate_channel import GateChannel
from celery_baton.leases import LeaseBook
from celery_baton.policy import RunPlan, TaskPolicy


class Releasing:
    """The Finisher of every admitted run, and the give-back of every lost grant."""

    def __init__(self, channel: GateChannel, book: LeaseBook) -> None:
        self.channel = channel
        self.book = book

    def finish(self, request: Any, policy: TaskPolicy, plan: RunPlan, *, final: bool) -> None:
        """Give back a run's leases; when final, mark its id done and free its unique key."""
        self.book.remove(plan.owner)
        done_key = plan.done_key if final else None
        unique_key = plan.unique_key if final and policy.unique_until == "finished" else None
        if not (plan.leases or done_key or unique_key):
            return
        self.channel.release(
            Release(
                tuple(lease.key for lease in plan.leases),
                plan.owner,
                done_key,
                policy.redelivery_retention,
                unique_key,
                request.id,
            )
        )

    def give_back(self, plan: RunPlan) -> None:
        """Free whatever the gate may have granted ``plan``'s owner (nothing runs)."""
        self.book.remove(plan.owner)
        if plan.leases:
            self.channel.release(Release(tuple(lease.key for lease in plan.leases), plan.owner))

    def give_back_later(self, plan: RunPlan) -> None:
        """Give back once more at the lease book's next tick: an unanswered ask may still
        be executed by a store that resumes after the first give-back."""
        if plan.leases:
            self.retry_later(Release(tuple(lease.key for lease in plan.leases), plan.owner))

    def free_unique(self, key: str, task_id: str) -> None:
        """Free a unique claim if ``task_id`` still holds it (a skipped or revoked run)."""
        self.channel.release(Release((), "", unique_key=key, unique_owner=task_id))

    def retry_later(self, release: Release) -> None:
        """A release the store did not confirm: the lease book retries it."""
        gate = self.channel.gate
        self.book.retry_later(lambda: gate.release_many([release]))
