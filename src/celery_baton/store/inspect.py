"""Read-only views of the store for the operator's commands (and ``unlock``)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from typing import Any

from celery_baton.store.connection import STORE_ERRORS, Store
from celery_baton.store.schema import hash_tag, owner_parts

LEASE_KINDS = {"ex": "exclusive", "cc": "concurrency", "run": "redelivery"}
UNIQUE_KIND = "uq"
#: The words a worker writes beside a beat slot's run lease (core.keys.beat_slot_material,
#: after "task: "): that lease makes a slot run once, whether the guard is on or off.
BEAT_SLOT_WORDS = ": beat entry "


@dataclass(frozen=True)
class LeaseRow:
    """One holder of a key: a lease (exclusive, concurrency, redelivery, beat slot) or a unique
    claim (``kind="unique"``: held by a queued or running task id, no worker)."""

    key: str
    kind: str
    task: str
    task_id: str
    worker: str
    fence: int
    ttl_left: float
    stale: bool = False  # its worker stopped reporting: it ends when ttl_left runs out
    label: str = ""  # the key in words (keys.words), written by its worker; '' if none

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _parse_key(key: str) -> tuple[str, str]:
    """``prefix:{task}:kind:digest`` -> (task, kind)."""
    task = hash_tag(key)
    kind = key[key.find("}") + 2 :].split(":", 1)[0]
    return task, kind


def label_key(lease_key: str) -> str:
    """Where a lease key's words are kept: ``prefix:{task}:label:ex:<digest>`` beside
    ``prefix:{task}:ex:<digest>`` (same slot; no lease listing's pattern matches it)."""
    end = lease_key.find("}:")
    return f"{lease_key[: end + 2]}label:{lease_key[end + 2 :]}"


def server_now_ms(store: Store) -> int:
    seconds, micros = store.client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def penalty_left(store: Store, key: str) -> float:
    """Seconds left of a named limit's penalty (``penalize``); 0 when none is in force."""
    until = store.client.get(key)
    if until is None:
        return 0.0
    return max(0.0, (int(until) - server_now_ms(store) * 1000) / 1e6)


def leases(store: Store, prefix: str) -> list[LeaseRow]:
    """Every live lease: exclusive, concurrency and redelivery-guard keys."""
    try:
        now = server_now_ms(store)
        rows: list[LeaseRow] = []
        for kind in LEASE_KINDS:
            for key in store.client.scan_iter(match=f"{prefix}:{{*}}:{kind}:*", count=1000):
                task, _ = _parse_key(key)
                for field, value in store.client.hgetall(key).items():
                    if not field.startswith("o:"):
                        continue
                    deadline, _, fence = value.partition(" ")
                    left = (int(deadline) - now) / 1000
                    if left <= 0:
                        continue
                    task_id, worker, _ = owner_parts(field[2:])
                    rows.append(
                        LeaseRow(
                            key, LEASE_KINDS[kind], task, task_id, worker, int(fence or 0), left
                        )
                    )
        return sorted(_with_labels(store, rows), key=lambda r: (r.task, r.key, r.ttl_left))
    except STORE_ERRORS as exc:
        raise store.unavailable(exc) from exc


def _with_labels(store: Store, rows: list[LeaseRow]) -> list[LeaseRow]:
    """Each row with its key in words, where its worker wrote them (one GET per key,
    pipelined: on Cluster the keys are on slots of their own)."""
    keys = sorted({row.key for row in rows})
    if not keys:
        return rows
    pipe = store.client.pipeline(transaction=False)
    for key in keys:
        pipe.get(label_key(key))
    found = dict(zip(keys, pipe.execute(), strict=True))
    return [_named(replace(row, label=str(found[row.key] or ""))) for row in rows]


def _named(row: LeaseRow) -> LeaseRow:
    """A run lease whose words name a beat slot is that slot's run-once lease."""
    if row.kind == LEASE_KINDS["run"] and BEAT_SLOT_WORDS in row.label:
        return replace(row, kind="beat slot")
    return row


def unique_claims(store: Store, prefix: str) -> list[LeaseRow]:
    """Every unique claim: the task id that holds it while queued or running."""
    try:
        rows = []
        for key in store.client.scan_iter(match=f"{prefix}:{{*}}:{UNIQUE_KIND}:*", count=1000):
            holder, ttl_ms = store.client.get(key), store.client.pttl(key)
            if holder is None:
                continue
            task, _ = _parse_key(key)
            words = store.client.get(label_key(key)) or ""  # written with the claim
            rows.append(
                LeaseRow(key, "unique", task, holder, "", 0, max(ttl_ms, 0) / 1000, label=words)
            )
        return sorted(rows, key=lambda r: (r.task, r.key))
    except STORE_ERRORS as exc:
        raise store.unavailable(exc) from exc


ORDERED_KIND = "ord"


@dataclass(frozen=True)
class OrderedLine:
    """An ordered key's line (ordered=, gate/ordered.lua): ``next`` the position whose
    turn it is (running, or not come yet), ``last`` the last position given at publish;
    ``skipped`` positions the gap bound skipped (``last_skip``: "<from>-<to> <ms>", the
    latest); ``gap_clock`` seconds on ``next``'s gap clock, as the gate counts them:
    since it became next, its last lease ran out or its retry was due (< 0: not started,
    a live lease or a retry not yet due; the gap bound skips ``next`` once it passes the
    bound and a later call asks). ``task_id``, ``worker``, ``ttl_left``: the call that
    holds the key's lease, running (``""``, ``""``, 0: none); ``held``: the calls of the
    key that wait in workers for their turn (they asked, and ask again); ``next_held``:
    ``next``'s own call is one of them (the gap bound never skips it). ``material``:
    the text the key was made of (``keys.words`` says it), ``label``: the key in words
    from its lease, where the line has no ``material`` (started by an unstamped call)."""

    key: str
    task: str
    next: int
    last: int
    skipped: int
    last_skip: str
    gap_clock: float
    task_id: str = ""
    worker: str = ""
    ttl_left: float = 0.0
    held: int = 0
    next_held: bool = False
    material: str | None = None
    label: str = ""

    @property
    def waiting(self) -> int:
        """Positions given and not ended: the one at ``next`` included."""
        return max(0, self.last - self.next + 1)

    @property
    def queued(self) -> int:
        """Positions given behind ``next``: the calls that wait for it."""
        return max(0, self.last - self.next)

    @property
    def idle(self) -> float:
        """Seconds ``next``'s call has not run (its gap clock, from 0)."""
        return max(0.0, self.gap_clock)

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        del data["material"], data["gap_clock"]
        return {**data, "waiting": self.waiting, "queued": self.queued, "idle": self.idle}


#: How many ordered keys one pipelined read asks for.
LINES_PAGE = 500


def lease_of_line(line_key: str) -> str:
    """An ordered key's exclusive lease (one run at a time), beside its line."""
    return line_key.replace(f":{ORDERED_KIND}:", ":ex:", 1)


def ordered_lines(store: Store, prefix: str) -> list[OrderedLine]:
    """Every ordered key's line the store keeps, with its lease's holder."""
    try:
        now = server_now_ms(store)
        keys = sorted(store.client.scan_iter(match=f"{prefix}:{{*}}:{ORDERED_KIND}:*", count=1000))
        lines = []
        # A record lives a week past its last publish: many keys, read a page at a time,
        # each page's record and lease in one pipelined round trip.
        for page in range(0, len(keys), LINES_PAGE):
            pipe = store.client.pipeline(transaction=False)
            for key in keys[page : page + LINES_PAGE]:
                pipe.hgetall(key)
                pipe.hgetall(lease_of_line(key))
            replies = pipe.execute()
            for n, key in enumerate(keys[page : page + LINES_PAGE]):
                record, lease = replies[2 * n], replies[2 * n + 1]
                if record:
                    lines.append(_line(store, key, record, lease, now))
        return sorted(lines, key=lambda line: (line.task, line.key))
    except STORE_ERRORS as exc:
        raise store.unavailable(exc) from exc


def _line(
    store: Store, key: str, record: dict[str, str], lease: dict[str, str], now: int
) -> OrderedLine:
    task, _ = _parse_key(key)
    next_ = int(record.get("q", 0))
    # As the gate's "Q" (gate/ordered.lua): the clock runs from the latest of `t` and
    # the deadlines of the key's leases, a lease that ran out (a killed holder) included.
    since, holder, deadline = int(record.get("t", now)), "", 0
    for field, value in lease.items():
        if field.startswith("o:"):
            until = int(value.split(" ", 1)[0])
            since = max(since, until)
            if until > now and until > deadline:
                holder, deadline = field[2:], until
    task_id, worker, _ = owner_parts(holder) if holder else ("", "", "")
    present = [int(f[2:]) for f, until in record.items() if f.startswith("p:") and int(until) > now]
    material = record.get("k")  # written at its first publish
    words = "" if material else store.client.get(label_key(lease_of_line(key))) or ""
    return OrderedLine(
        key,
        task,
        next_,
        int(record.get("n", 0)),
        int(record.get("g", 0)),
        str(record.get("gl", "")),
        (now - since) / 1000,
        task_id=task_id,
        worker=worker,
        ttl_left=max(0, deadline - now) / 1000,
        held=sum(1 for p in present if p >= next_),
        next_held=next_ in present,
        material=str(material) if material else None,
        label=str(words),
    )


BATCH_TAG = "batch:"


@dataclass(frozen=True)
class BatchRun:
    """A batch of a batch key that a worker claimed and runs (``runs`` of core/batch.py):
    its id (``<worker>/<nonce>/<micros>``), its ``worker``'s hostname, its ``calls``, the
    seconds ``ttl_left`` before its calls wait again if its worker stops renewing it, and
    its ``age`` (seconds since it was claimed)."""

    run: str
    worker: str
    calls: int
    ttl_left: float
    age: float
    stale: bool = False  # its worker stopped reporting: its calls wait again at ttl_left


@dataclass(frozen=True)
class BatchLine:
    """A batch key's calls (batch=, core/batch.py): ``waiting`` calls registered and not
    in a batch yet, the ``oldest`` one's age in seconds (0: none waits), and the batches
    that ``runs`` now. ``key``: the key's store keys' common part, ``prefix:{batch:<task>:
    <digest>}``; ``label``: the key in words, as the workers that hold its calls wrote it."""

    key: str
    task: str
    waiting: int
    oldest: float
    runs: tuple[BatchRun, ...] = ()
    label: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def batch_lines(store: Store, prefix: str) -> list[BatchLine]:
    """Every batch key with calls waiting or a batch running."""
    try:
        now = server_now_ms(store)
        bases = set()
        for part in ("pending", "runs"):
            for key in store.client.scan_iter(
                match=f"{prefix}:{{{BATCH_TAG}*}}:{part}", count=1000
            ):
                bases.add(key.rsplit(":", 1)[0])
        ordered = sorted(bases)
        pipe = store.client.pipeline(transaction=False)
        for base in ordered:
            pipe.zcard(f"{base}:pending")
            pipe.zrange(f"{base}:pending", 0, 0, withscores=True)
            pipe.zrange(f"{base}:runs", 0, -1, withscores=True)
            pipe.hvals(f"{base}:claimed")
            pipe.get(f"{base}:label")
        replies = pipe.execute() if ordered else []
    except STORE_ERRORS as exc:
        raise store.unavailable(exc) from exc
    lines = []
    for n, base in enumerate(ordered):
        waiting, oldest, runs, claimed, words = replies[5 * n : 5 * n + 5]
        per_run: dict[str, int] = {}
        for value in claimed:  # "<run> <registered ms>"
            run = str(value).rsplit(" ", 1)[0]
            per_run[run] = per_run.get(run, 0) + 1
        live = tuple(
            _batch_run(str(run), int(until), per_run.get(str(run), 0), now)
            for run, until in runs
            if int(until) > now  # a lapsed run's calls wait again at the next tick
        )
        if not waiting and not live:
            continue
        task = hash_tag(base)[len(BATCH_TAG) :].rsplit(":", 1)[0]
        age = max(0.0, (now - int(oldest[0][1])) / 1000) if oldest else 0.0
        lines.append(BatchLine(base, task, int(waiting), age, live, label=str(words or "")))
    return sorted(lines, key=lambda line: (line.task, line.key))


def _batch_run(run: str, until: int, calls: int, now: int) -> BatchRun:
    worker, _, micros = run.rpartition("/")  # "<hostname>/<nonce>/<micros>"
    hostname = worker.rpartition("/")[0] or worker
    claimed = int(micros) // 1000 if micros.isdigit() else now
    return BatchRun(run, hostname, calls, (until - now) / 1000, max(0.0, (now - claimed) / 1000))


def is_unique_claim(key: str) -> bool:
    return _parse_key(key)[1] == UNIQUE_KIND


def workers(store: Store, prefix: str) -> list[dict[str, Any]]:
    """The reports live workers publish every renewal interval."""
    try:
        _, values = _scan_values(store, f"{prefix}:worker:*")
    except STORE_ERRORS as exc:
        raise store.unavailable(exc) from exc
    return [json.loads(v) for v in values if v]


def _scan_values(store: Store, pattern: str) -> tuple[list[Any], list[Any]]:
    """The keys matching ``pattern``, sorted, and their values: one GET each, pipelined
    (on Cluster the keys are on slots of their own, where one MGET of several slots is
    refused)."""
    keys = sorted(store.client.scan_iter(match=pattern, count=1000))
    pipe = store.client.pipeline(transaction=False)
    for key in keys:
        pipe.get(key)
    return keys, (pipe.execute() if keys else [])


def limit_overrides(store: Store, key: str) -> dict[str, str]:
    try:
        return dict(store.client.hgetall(key))
    except STORE_ERRORS as exc:
        raise store.unavailable(exc) from exc


def set_limit_override(store: Store, key: str, field: str, value: str | None) -> None:
    try:
        if value is None:
            store.client.hdel(key, field)
        else:
            store.client.hset(key, field, value)
    except STORE_ERRORS as exc:
        raise store.unavailable(exc) from exc


def label(store: Store, key: str) -> str:
    """``key`` in words, where its holder's worker wrote them ('' if not)."""
    try:
        return str(store.client.get(label_key(key)) or "")
    except STORE_ERRORS as exc:
        raise store.unavailable(exc) from exc


def exists(store: Store, key: str) -> bool:
    try:
        return bool(store.client.exists(key))
    except STORE_ERRORS as exc:
        raise store.unavailable(exc) from exc


def unlock(store: Store, key: str, *, force: bool, channel: str) -> tuple[int, list[str]]:
    """Free ``key``'s expired holders, and live ones with ``force``: (removed, live owners).

    A unique claim has one holder, the task id that claimed it; freeing it lets the
    next publish of that key be queued."""
    try:
        if is_unique_claim(key):
            holder = store.client.get(key)
            if holder is None:
                return 0, []
            if not force:
                return 0, [f"{holder}|"]
            return int(store.client.delete(key)), [f"{holder}|"]
        reply = store.scripts.run("unlock", [key], ["1" if force else "0", channel])
    except STORE_ERRORS as exc:
        raise store.unavailable(exc) from exc
    return int(reply[0]), [str(x) for x in reply[1:]]


def rate_ahead_us(store: Store, prefix: str, task: str) -> list[int]:
    """How far each of ``task``'s rate keys runs ahead of now (microseconds, >= 0).

    A GCRA key stores its theoretical arrival time; ``ahead / interval`` is the part of
    the burst in use, and 0 means the rate is idle (the web view shows both)."""
    try:
        seconds, micros = store.client.time()
        now_us = int(seconds) * 1_000_000 + int(micros)
        keys = list(store.client.scan_iter(match=f"{prefix}:{{{task}}}:rate:*", count=1000))
        values = store.client.mget(keys) if keys else []
    except STORE_ERRORS as exc:
        raise store.unavailable(exc) from exc
    return [max(0, int(v) - now_us) for v in values if v]


def worker_report_ttls(store: Store, prefix: str) -> dict[str, float]:
    """Seconds left before each worker's report expires, by hostname (its age, read
    backwards: a live worker rewrites it every renewal interval)."""
    try:
        keys = sorted(store.client.scan_iter(match=f"{prefix}:worker:*", count=1000))
        pipe = store.client.pipeline(transaction=False)
        for key in keys:
            pipe.pttl(key)
        ttls = pipe.execute() if keys else []
    except STORE_ERRORS as exc:
        raise store.unavailable(exc) from exc
    marker = f"{prefix}:worker:"
    return {k[len(marker) :]: max(int(t), 0) / 1000 for k, t in zip(keys, ttls, strict=True)}


def store_epoch_age(store: Store, prefix: str) -> float | None:
    """Seconds since the store was last found new or without its data (None: it has no
    epoch yet, so the next lease starts a grace; see gate.lua, kind "G")."""
    try:
        value = store.client.get(f"{prefix}:epoch")
        if value is None:
            return None
        # "<since ms> <replication id>" (gate.lua, "G"); an operator's "0" has no id.
        return max(0.0, (server_now_ms(store) - int(str(value).split()[0])) / 1000)
    except STORE_ERRORS as exc:
        raise store.unavailable(exc) from exc


def family_graces(store: Store, prefix: str) -> dict[str, float]:
    """Redis Cluster: the task families whose epoch holds a grace still in force (their
    shard lost its data or changed master; gate.lua, kind "E"), seconds left by task."""
    try:
        now = server_now_ms(store)
        keys, values = _scan_values(store, f"{prefix}:{{*}}:epoch")
    except STORE_ERRORS as exc:
        raise store.unavailable(exc) from exc
    graces = {}
    for key, value in zip(keys, values, strict=True):
        # "<id> <replication id>[ <grace until, ms>]"
        parts = str(value or "").split()
        if len(parts) > 2 and parts[2].isdigit() and int(parts[2]) > now:
            graces[_parse_key(key)[0]] = (int(parts[2]) - now) / 1000
    return graces


def end_grace(store: Store, prefix: str) -> None:
    """Declare that no lease from before a loss can be live (the store is new, or every
    worker was stopped): the store-wide epoch is set to the start of time."""
    try:
        store.client.set(f"{prefix}:epoch", 0)
    except STORE_ERRORS as exc:
        raise store.unavailable(exc) from exc


#: The only maxmemory-policy that never drops a key: under any other, a full server
#: may evict leases (volatile-*: they have a TTL), limits and beat slots, silently.
SAFE_EVICTION = "noeviction"


def eviction_policy(store: Store) -> str | None:
    """The server's ``maxmemory-policy``; None when it cannot be read (a managed store
    may refuse ``CONFIG``)."""
    try:
        reply = store.client.config_get("maxmemory-policy")
    except STORE_ERRORS as exc:
        raise store.unavailable(exc) from exc
    except Exception:  # CONFIG refused or renamed (ResponseError), or an odd reply
        return None
    if isinstance(reply, dict) and len(reply) == 1 and not store.cluster:
        return str(next(iter(reply.values())))
    if isinstance(reply, dict):  # Cluster: every node's reply; the first one that evicts
        values = [str(v) for v in _config_values(reply)]
        risky = [v for v in values if v != SAFE_EVICTION]
        return risky[0] if risky else (values[0] if values else None)
    return None


def _config_values(reply: dict[Any, Any]) -> list[Any]:
    values: list[Any] = []
    for value in reply.values():
        if isinstance(value, dict):
            values.extend(value.values())
        else:
            values.append(value)
    return values


def eviction_warning(policy: str | None) -> str:
    """What an operator is told about ``policy`` ('' when nothing to say)."""
    if policy is None:
        return (
            "cannot check the store's maxmemory-policy (CONFIG refused): it must be "
            "noeviction, or a full store drops leases and limits silently"
        )
    if policy == SAFE_EVICTION:
        return ""
    return (
        f"the store's maxmemory-policy is {policy!r}: when it is full it evicts keys, and "
        "celery-baton's leases, limits and beat slots are lost without a trace (two runs "
        "of an exclusive key, a limit exceeded); set maxmemory-policy noeviction, or give "
        "celery-baton a store of its own"
    )
