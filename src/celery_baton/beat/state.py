"""The beat's state in the store: key names and one method per script.

Every Celery app has its own schedule: two projects pointed at one store (every project
on a developer's machine shares the embedded one) must neither follow each other's
leader nor remove each other's entries. So the app's name (``app.main``) is part of
every key. Keys (all of one app share the ``{beat:<app>}`` hash tag, so Redis Cluster
keeps them on one node and every script can touch several of them)::

    <prefix>:{beat:<app>}:leader          hash  owner, fence, since (ms); expires with
                                                the lease
    <prefix>:{beat:<app>}:fence           int   fencing counter, grows with every leadership
    <prefix>:{beat:<app>}:version         int   bumped by every schedule change
    <prefix>:{beat:<app>}:names           set   entry names
    <prefix>:{beat:<app>}:entry:<name>    hash  next, fp, last_slot, last_id, paused,
                                                trigger, source, app, task, schedule,
                                                policy, def, counters
    <prefix>:{beat:<app>}:history:<name>  list  JSON lines, newest first, bounded
    <prefix>:{beat:<app>}:outbox          hash  task id -> JSON {entry, slot, kind}:
                                                claimed, not yet known to be published
    <prefix>:{beat:<app>}:refused         hash  entry name -> why this beat refused it

Celery-free.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from celery_baton.core.keys import digest
from celery_baton.core.policy.slot_runs import beat_base
from celery_baton.store.connection import Store

#: The schedule name of an app created without a name (``Celery()``).
UNNAMED_APP = "default"


def schedule_name(main: str | None) -> str:
    """The name an app's beat keys carry: ``app.main``, made safe for a hash tag."""
    name = main or UNNAMED_APP
    # A brace would end the hash tag early; such a name is replaced by its digest.
    return digest(name) if "{" in name or "}" in name else name


@dataclass(frozen=True)
class BeatKeys:
    prefix: str = "baton"
    app: str = UNNAMED_APP

    @property
    def base(self) -> str:
        return beat_base(self.prefix, self.app)

    @property
    def leader(self) -> str:
        return f"{self.base}:leader"

    @property
    def fence(self) -> str:
        return f"{self.base}:fence"

    @property
    def version(self) -> str:
        return f"{self.base}:version"

    @property
    def names(self) -> str:
        return f"{self.base}:names"

    @property
    def outbox(self) -> str:
        return f"{self.base}:outbox"

    @property
    def refused(self) -> str:
        return f"{self.base}:refused"

    def entry(self, name: str) -> str:
        return f"{self.base}:entry:{name}"

    def history(self, name: str) -> str:
        return f"{self.base}:history:{name}"


@dataclass(frozen=True)
class LeadReply:
    leading: bool
    fence: int
    server_ms: int
    version: int
    holder: str
    holder_ttl_ms: int


@dataclass(frozen=True)
class Claim:
    """One entry's claim: arguments of ``beat_claim``."""

    name: str
    expected_next: int
    fingerprint: str
    new_next: int | None  # None: a trigger, the next slot stays
    trigger: str  # '' unless a trigger
    last_slot: int | None
    last_id: str
    # The stored last slot this claim follows (None: none yet), checked by the script;
    # "*": not checked (a trigger, or a claim written back after the store lost it).
    expected_last: int | str | None
    outbox: Sequence[tuple[str, str]]  # (task id, JSON)
    history: Sequence[str]  # oldest first
    fired: int
    missed: int
    suppressed: int


class BeatState:
    """Script calls on the beat's keys. Raises the client's errors; callers decide."""

    def __init__(self, store: Store, prefix: str = "baton", app: str = UNNAMED_APP) -> None:
        self.store = store
        self.keys = BeatKeys(prefix, app)

    @property
    def client(self) -> Any:
        return self.store.client

    def lead(self, owner: str, ttl_ms: int) -> LeadReply:
        k = self.keys
        raw = self.store.scripts.run("beat_lead", [k.leader, k.fence, k.version], [owner, ttl_ms])
        return LeadReply(
            leading=int(raw[0]) == 1,
            fence=int(raw[1] or 0),
            server_ms=int(raw[2]),
            version=int(raw[3]),
            holder=str(raw[4] or ""),
            holder_ttl_ms=int(raw[5]),
        )

    def resign(self, owner: str) -> bool:
        return int(self.store.scripts.run("beat_resign", [self.keys.leader], [owner])) == 1

    def define(
        self,
        *,
        owner: str,
        fence: int,
        mode: str,
        name: str,
        fingerprint: str,
        next_slot: int,
        edited_line: str,
        history_max: int,
        fields: dict[str, str],
        pipe: Any = None,
    ) -> Any:
        """``beat_define``: returns ``[status, next, changed]`` (or queues it on ``pipe``)."""
        k = self.keys
        args: list[Any] = [owner, fence, mode, name, fingerprint, next_slot, edited_line]
        args.append(history_max)
        for field, value in fields.items():
            args += [field, value]
        keys = [k.entry(name), k.names, k.leader, k.version, k.history(name)]
        # Every entry records the app that defined it: see beat_remove.
        args += ["app", k.app]
        return self.store.scripts.run("beat_define", keys, args, client=pipe)

    def remove(self, *, owner: str, fence: int, name: str, source: str, pipe: Any = None) -> Any:
        k = self.keys
        keys = [k.entry(name), k.names, k.leader, k.version, k.history(name), k.outbox]
        return self.store.scripts.run(
            "beat_remove", keys, [owner, fence, name, source, k.app], client=pipe
        )

    def claim(self, owner: str, fence: int, claim: Claim, history_max: int, pipe: Any) -> Any:
        k = self.keys
        args: list[Any] = [
            owner,
            fence,
            claim.expected_next,
            claim.fingerprint,
            "" if claim.new_next is None else claim.new_next,
            claim.trigger,
            "" if claim.last_slot is None else claim.last_slot,
            claim.last_id,
            history_max,
            claim.fired,
            claim.missed,
            claim.suppressed,
            "" if claim.expected_last is None else claim.expected_last,
            len(claim.outbox),
        ]
        for task_id, payload in claim.outbox:
            args += [task_id, payload]
        args.append(len(claim.history))
        args += list(claim.history)
        keys = [k.leader, k.entry(claim.name), k.outbox, k.history(claim.name)]
        return self.store.scripts.run("beat_claim", keys, args, client=pipe)

    def sent(self, task_ids: Sequence[str]) -> int:
        if not task_ids:
            return 0
        return int(self.store.scripts.run("beat_sent", [self.keys.outbox], list(task_ids)))

    def mark(self, name: str, op: str) -> bool:
        k = self.keys
        return int(self.store.scripts.run("beat_mark", [k.entry(name), k.version], [op])) == 1

    def load(self) -> dict[str, dict[str, str]]:
        """Every stored entry's hash, by name (two round trips)."""
        names = sorted(self.client.smembers(self.keys.names))
        if not names:
            return {}
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            pipe.hgetall(self.keys.entry(name))
        return {name: h for name, h in zip(names, pipe.execute(), strict=True) if h}

    def outbox(self) -> dict[str, dict[str, Any]]:
        raw = self.client.hgetall(self.keys.outbox)
        return {task_id: json.loads(payload) for task_id, payload in raw.items()}

    def set_refused(self, refused: dict[str, str]) -> None:
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(self.keys.refused)
        if refused:
            pipe.hset(self.keys.refused, mapping=refused)
        pipe.execute()
