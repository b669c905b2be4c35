"""The Gate: everything a run needs before it may start, decided in ONE script call.

A run may need an exclusive lease, a concurrency lease, a rate reservation, and proof
that its task id has not finished already. Asking for them one by one would let two
workers each take half (deadlock) or let a rate token be spent by a run that then
cannot get its lease. The gate script checks every condition first and writes only
when all of them pass, on the server's clock. Celery-free.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from celery_baton.core.conditions import (
    Condition,
    StoreGrace,
    TakeLease,
    WeightedRate,
    encode,
    slot_groups,
    spans_slots,
)
from celery_baton.core.keys import epoch_key
from celery_baton.errors import StoreUnavailable
from celery_baton.store import inspect as store_inspect
from celery_baton.store.connection import STORE_ERRORS, Store
from celery_baton.store.schema import hash_tag, owner_parts


@dataclass(frozen=True)
class Decision:
    """The gate's answer. When denied, ``retry_after`` is in seconds (-1: never)."""

    granted: bool
    fence: int = 0
    start_after: float = 0.0  # seconds: a reserved rate slot starts later
    at_us: int = 0  # granted: the start instant on the store's clock (us since the epoch)
    denied_by: Condition | None = None
    retry_after: float = 0.0
    holder: str = ""
    # Granted with a lease: the store epoch of the leases' family, for their renewals.
    epoch: str = ""
    # The publish order a PublishOrder without one was given now (0: none given).
    seq: int = 0
    # What an InOrder condition did besides passing (core/ordered.py, Note).
    note: str = ""

    @property
    def holder_task_id(self) -> str:
        return owner_task_id(self.holder)


def owner_task_id(owner: str) -> str:
    """The task id of an owner token (store/schema.py)."""
    return owner_parts(owner)[0]


@dataclass(frozen=True)
class Release:
    """What a finished run gives back: its leases, and when final its id and unique key."""

    lease_keys: tuple[str, ...]
    owner: str
    done_key: str | None = None
    done_ttl: float = 0.0
    unique_key: str | None = None
    unique_owner: str = ""
    # > 0: keep the unique claim this many seconds instead of freeing it (the run ended,
    # but its message is still the broker's and comes back: worker/request.py)
    unique_keep: float = 0.0
    # The publish whose run finished (policy/headers.PUBLISH_HEADER; '': unstamped), recorded
    # in the done marker: a copy of that publish is refused, another publish runs.
    done_stamp: str = ""
    # A scheduled beat slot (SlotRun.link): ``done_key`` is its entry's run record.
    done_link: str = ""
    # An ordered call's end (core/ordered.py): "<epoch> <position> <final 1|0> <hold ms>"
    # ('' : none), its key's order record and exclusive lease (announced on an advance).
    order: str = ""
    order_key: str = ""
    order_lease: str = ""
    # > 0: freed by the run's own process as its body ended, before its worker's main
    # process knows (it renews them meanwhile): each freed lease is marked ended for this
    # many seconds, so that those renewals read ENDED, not LOST (release.lua, renew.lua).
    # A worker's own processes tell its renewer in memory instead (core/shared_ends.py)
    # and pass 0: a mark nobody clears would pile up in a busy concurrency key.
    ended_mark: float = 0.0

    @classmethod
    def unique_claim(cls, unique_key: str, task_id: str) -> Release:
        """Free ``task_id``'s unique claim of ``unique_key`` alone (a task that never ran:
        skipped, revoked, cancelled); a claim another task took meanwhile stays."""
        return cls((), "", unique_key=unique_key, unique_owner=task_id)

    def script_call(self, channel: str) -> tuple[list[str], list[Any]]:
        keys = list(self.lease_keys)
        done_ms = 0
        if self.done_key and self.done_ttl > 0:
            keys.append(self.done_key)
            done_ms = max(1, round(self.done_ttl * 1000))
        unique_owner = ""
        keep_ms = 0
        if self.unique_key and self.unique_owner:
            keys.append(self.unique_key)
            unique_owner = self.unique_owner
            if self.unique_keep > 0:
                keep_ms = max(1, round(self.unique_keep * 1000))
        args = [self.owner, len(self.lease_keys), done_ms, unique_owner, channel, keep_ms]
        if done_ms:
            args.append(self.done_stamp)
            if self.done_link:
                args.append(self.done_link)
        if self.order:
            args += [""] * (8 - len(args))  # ARGV[7], ARGV[8] unused: release.lua
            args += [self.order, self.order_lease]
            keys.append(self.order_key)
        if self.ended_mark > 0 and self.lease_keys:
            args += [""] * (10 - len(args))  # ARGV[7..10] unused: release.lua
            args.append(max(1, round(self.ended_mark * 1000)))
        return keys, args


@dataclass(frozen=True)
class HeldClaim:
    """The unique claim of a running task whose message expires, renewed with its run's
    leases (unique_keep.lua): held while the run lives, and ``expires_at`` (wall clock,
    seconds since the epoch) so that a copy the broker gives back unexpired still finds
    it; after both, it lapses, since a copy that comes back later is discarded."""

    key: str
    task_id: str
    ttl: float
    expires_at: float

    def ttl_from(self, now: float) -> float:
        return max(self.ttl, self.expires_at - now)


@dataclass(frozen=True)
class HeldLease:
    """A lease as its holder knows it, for batched renewal.

    ``epoch`` is the store epoch it was granted under (``Decision.epoch``): a renewal
    writes a missing lease back only when the store forgot it (the epoch changed), never
    when it was released, unlocked or expired (see renew.lua). ``""``: unknown, written
    back whenever the key has room.
    """

    key: str
    owner: str
    limit: int
    ttl: float
    epoch: str = ""


class Renewal(NamedTuple):
    """One lease's renewal: ``status`` 1 renewed, 2 re-asserted (the store had forgotten
    it; ``epoch`` is the store's new epoch, to renew under from now on), 0 lost (released,
    unlocked, expired, or taken by another owner), 3 ended (freed by its run's own process
    as the body ended: ``Release.ended_mark``)."""

    status: int
    epoch: str = ""


RENEWED, REASSERTED, LOST, ENDED = 1, 2, 0, 3

logger = logging.getLogger("celery_baton.core.gate")

#: A refusal that waiting cannot help (``retry_after`` -1) is asked again this often (s)
#: by a wait without a deadline: what it waits for comes from outside the gate.
NEVER_RETRY = 0.5


class Gate:
    """Runs the gate, release and renew scripts against one store.

    >>> gate = Gate(connect("redis://127.0.0.1:6379/0"))  # doctest: +SKIP
    >>> gate.decide([TakeLease("baton:{t}:ex:k")], owner="id|w|1")  # doctest: +SKIP
    Decision(granted=True, fence=1732240000000000, ...)
    """

    def __init__(
        self,
        store: Store,
        *,
        notice_channel: str = "baton:released",
        grace_key: str | None = None,
    ) -> None:
        self.store = store
        self.notice_channel = notice_channel
        self._cluster = store.cluster
        # The store-wide epoch (see gate.lua, "G"): on one server only, since a
        # script's keys must share a Cluster slot.
        self.grace_key = None if store.cluster else grace_key

    def call(
        self, conditions: Sequence[Condition], owner: str, ttl: float, reserve: float
    ) -> tuple[list[str], list[Any]]:
        """The gate script's KEYS and ARGV for ``conditions`` on this store."""
        return gate_call(conditions, owner, ttl, reserve, grace_key=self.grace_key)

    def decision(self, conditions: Sequence[Condition], reply: Any) -> Decision:
        return parse_decision(conditions, reply, grace_key=self.grace_key)

    def decide(
        self,
        conditions: Sequence[Condition],
        *,
        owner: str,
        ttl: float = 10.0,
        reserve: float = 0.0,
    ) -> Decision:
        """Grant all ``conditions`` to ``owner`` or none; raises StoreUnavailable.

        ``reserve`` (seconds): a rate slot free within it is taken now, and the decision
        says when the run may start (``start_after``).
        """
        if self._cluster and spans_slots(conditions):
            return self._decide_across(conditions, owner, ttl, reserve)
        return self._decide_one(conditions, owner, ttl, reserve)

    def wait_for_grant(
        self,
        conditions: Sequence[Condition],
        *,
        owner: str,
        reserve: float = 0.0,
        deadline: float | None = None,
        store_retry: float | None = None,
        subject: str = "a grant",
    ) -> Decision:
        """Ask for ``conditions`` until the gate grants them, sleeping as it says between
        asks (``retry_after``, on the store's clock); a grant is returned once its
        reserved slot has come (``start_after`` slept here).

        ``deadline`` (a ``time.monotonic()`` instant; None: no bound): a refusal whose
        wait would end past it is returned as it is, denied, for the caller to say why;
        the reservation window never reaches past it. ``store_retry`` (seconds; None: a
        StoreUnavailable is raised): a store that does not answer is asked again after
        that long, the error logged, until the deadline (then raised). A refusal that
        waiting cannot help (``retry_after`` -1: a done marker, an order passed) is
        returned at once under a deadline and asked again every ``NEVER_RETRY`` without.
        """
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            window = reserve if left is None else max(0.0, min(reserve, left))
            try:
                decision = self.decide(conditions, owner=owner, reserve=window)
            except StoreUnavailable as exc:
                if store_retry is None or (left is not None and left < store_retry):
                    raise
                logger.warning("baton: %s waits for the store: %s", subject, exc)
                time.sleep(store_retry)
                continue
            if decision.granted:
                if decision.start_after > 0:
                    time.sleep(decision.start_after)
                return decision
            if decision.retry_after < 0:
                if left is not None:
                    return decision
                time.sleep(NEVER_RETRY)
                continue
            wait = max(decision.retry_after, 0.001)
            if deadline is not None and time.monotonic() + wait > deadline:
                return decision
            time.sleep(wait)

    def _decide_across(
        self, conditions: Sequence[Condition], owner: str, ttl: float, reserve: float
    ) -> Decision:
        """Redis Cluster, a task that uses named limits: their keys hash to their own
        slots, the task's to its family's, and one script cannot touch both. Reserve
        then confirm: each named limit's slot is asked first (in a fixed order), then
        the task's own keys; a refusal gives back what the earlier calls took
        (limit_give_back.lua), so a refused run never spends a shared budget and no
        run passes without every slot's grant: never over-admitted."""
        groups = slot_groups(conditions)
        taken: list[tuple[list[Condition], Decision]] = []
        start_at = 0  # the latest instant a step reserved (us, server clock)
        decision = Decision(True)
        for group in groups:
            try:
                decision = self._decide_one(group, owner, ttl, reserve)
            except BaseException:
                with contextlib.suppress(Exception):  # the store failed: best effort
                    self._give_back(taken)
                raise
            if not decision.granted:
                self._give_back(taken)
                return decision
            taken.append((group, decision))
            start_at = max(start_at, decision.at_us)
        # The run starts when every step's slot has come: seconds from the last step's now.
        now_us = decision.at_us - round(decision.start_after * 1_000_000)
        return dataclasses.replace(
            decision, start_after=max(0, start_at - now_us) / 1_000_000, at_us=start_at
        )

    def _decide_one(
        self, conditions: Sequence[Condition], owner: str, ttl: float, reserve: float
    ) -> Decision:
        keys, args = self.call(conditions, owner, ttl, reserve)
        try:
            reply = self.store.scripts.call("gate", keys, args)
        except STORE_ERRORS as exc:
            raise self.store.unavailable(exc) from exc
        return self.decision(conditions, reply)

    def _give_back(self, taken: Sequence[tuple[Sequence[Condition], Decision]]) -> None:
        for group, decision in taken:
            written_us = decision.at_us - round(decision.start_after * 1_000_000)
            rates = [c for c in group if isinstance(c, WeightedRate)]
            if not rates:
                continue
            keys = [c.key for c in rates]
            args = [f"{c.increment_us} {written_us + c.increment_us}" for c in rates]
            try:
                self.store.scripts.call("limit_give_back", keys, args)
            except STORE_ERRORS as exc:
                raise self.store.unavailable(exc) from exc

    def penalize(self, key: str, seconds: float) -> float:
        """Hold every admission under the named limit of penalty ``key`` for ``seconds``
        from now (extends, never shortens); returns the seconds it now lasts."""
        try:
            until = self.store.scripts.call("limit_penalize", [key], [round(seconds * 1e6)])
            now_s, now_us = self.store.client.time()
        except STORE_ERRORS as exc:
            raise self.store.unavailable(exc) from exc
        return max(0.0, (int(until) - (int(now_s) * 1_000_000 + int(now_us))) / 1e6)

    def release(
        self,
        lease_keys: Sequence[str],
        *,
        owner: str,
        done_key: str | None = None,
        done_ttl: float = 0.0,
        unique_key: str | None = None,
        unique_owner: str = "",
        done_stamp: str = "",
    ) -> int:
        """Free ``owner``'s leases (never another owner's); mark done; free a unique key."""
        keys, args = Release(
            tuple(lease_keys),
            owner,
            done_key,
            done_ttl,
            unique_key,
            unique_owner,
            done_stamp=done_stamp,
        ).script_call(self.notice_channel)
        try:
            return int(self.store.scripts.call("release", keys, args))
        except STORE_ERRORS as exc:
            raise self.store.unavailable(exc) from exc

    def keep_claims(self, claims: Sequence[HeldClaim], now: float) -> list[bool]:
        """Extend running tasks' unique claims in one round trip (one single-key call
        each, pipelined): False for a claim that is gone or another task id's."""
        if not claims:
            return []
        calls = [([c.key], [c.task_id, max(1, round(c.ttl_from(now) * 1000))]) for c in claims]
        try:
            return [bool(kept) for kept in self.store.scripts.call_many("unique_keep", calls)]
        except STORE_ERRORS as exc:
            raise self.store.unavailable(exc) from exc

    def eviction_warning(self) -> str:
        """What the worker says at start about the store's ``maxmemory-policy``: '' for
        ``noeviction``, a warning for a policy that may evict leases, or that it
        cannot be checked (store/inspect.py)."""
        return store_inspect.eviction_warning(store_inspect.eviction_policy(self.store))

    def connect_ahead(self) -> None:
        """Connect to the store now, before this process's first call needs it."""
        try:
            self.store.scripts.connect_ahead()
        except STORE_ERRORS as exc:
            raise self.store.unavailable(exc) from exc

    def release_many(self, releases: Sequence[Release]) -> list[int]:
        """Several releases in one round trip (a pipeline of release scripts)."""
        calls = [r.script_call(self.notice_channel) for r in releases]
        try:
            return [int(freed) for freed in self.store.scripts.call_many("release", calls)]
        except STORE_ERRORS as exc:
            raise self.store.unavailable(exc) from exc

    def renew(self, leases: Sequence[HeldLease]) -> list[Renewal]:
        """Renew many leases in one round trip; one :class:`Renewal` per lease."""
        if not leases:
            return []
        try:
            if not self._cluster:
                return _renewals(self._renew_batch(leases))
            # Cluster: a script's keys must share a slot, so one call per hash tag,
            # all in one pipeline.
            by_tag: dict[str, list[int]] = defaultdict(list)
            for i, lease in enumerate(leases):
                by_tag[hash_tag(lease.key)].append(i)
            results = [Renewal(LOST)] * len(leases)
            pipe = self.store.client.pipeline(transaction=False)
            for indexes in by_tag.values():
                self._renew_batch([leases[i] for i in indexes], pipe)
            for indexes, reply in zip(by_tag.values(), pipe.execute(), strict=True):
                for i, renewal in zip(indexes, _renewals(reply), strict=True):
                    results[i] = renewal
            return results
        except STORE_ERRORS as exc:
            raise self.store.unavailable(exc) from exc

    def _renew_batch(self, leases: Sequence[HeldLease], pipe: Any = None) -> Any:
        keys: list[str] = []
        args: list[Any] = []
        for lease in leases:
            keys += (lease.key, epoch_key(lease.key))
            args += (lease.owner, lease.limit, max(1, round(lease.ttl * 1000)), lease.epoch)
        if self.grace_key is not None:
            args.append(1)  # the store-wide epoch holds the grace after a promotion
        return self.store.scripts.run("renew", keys, args, client=pipe)


def _renewals(reply: Sequence[Any]) -> list[Renewal]:
    """renew.lua's reply: a status and an epoch per lease."""
    return [Renewal(int(reply[i]), str(reply[i + 1] or "")) for i in range(0, len(reply), 2)]


def gate_call(
    conditions: Sequence[Condition],
    owner: str,
    ttl: float,
    reserve: float = 0.0,
    *,
    grace_key: str | None = None,
) -> tuple[list[str], list[Any]]:
    """The gate script's KEYS and ARGV for ``conditions`` (and, when a lease is asked for,
    the keys of its family's epoch and of the store's grace, past the conditions' keys)."""
    args: list[Any] = [owner, max(1, round(ttl * 1000)), round(reserve * 1_000_000)]
    keys = []
    lease_key = None
    for c in conditions:
        args += encode(c)
        keys.append(c.key)
        if lease_key is None and isinstance(c, TakeLease):
            lease_key = c.key
    if lease_key is not None:  # keys past the conditions' (gate.lua, "E" and "G")
        keys.append(epoch_key(lease_key))
        if grace_key is not None:  # no new lease while the store's grace lasts
            keys.append(grace_key)
    return keys, args


def parse_decision(
    conditions: Sequence[Condition], reply: Any, *, grace_key: str | None = None
) -> Decision:
    """The gate script's reply as a Decision."""
    if reply[0] == 1:
        return Decision(
            True,
            fence=int(reply[1]),
            start_after=int(reply[2]) / 1_000_000,
            at_us=int(reply[3]) if len(reply) > 3 else 0,
            epoch=str(reply[4] or "") if len(reply) > 4 else "",
            seq=int(reply[5] or 0) if len(reply) > 5 else 0,
            note=_text(reply[6]) if len(reply) > 6 else "",
        )
    retry_us = int(reply[2])
    index = int(reply[1])
    return Decision(
        False,
        # Past the caller's conditions: the grace condition gate_call added.
        denied_by=conditions[index - 1]
        if index <= len(conditions)
        else StoreGrace(grace_key or ""),
        retry_after=-1.0 if retry_us < 0 else retry_us / 1_000_000,
        holder=str(reply[3] or ""),
        seq=int(reply[4] or 0) if len(reply) > 4 else 0,
        note=_text(reply[5]) if len(reply) > 5 else "",
    )


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value or "")
