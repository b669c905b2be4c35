"""The operators' read model: what the store holds, read in one place and shaped as
plain data that both the CLI (``ops/cli``) and the web view (``ops/web``) render.

Celery-free: it reads through a :class:`Source` (the CLI's ``Context`` is one) and,
for the beat schedule, a :class:`Schedules` (``ScheduleStore`` is one).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from celery_baton.core.keys import words
from celery_baton.core.rates import parse_rate, rate_text
from celery_baton.errors import BatonError
from celery_baton.store import inspect as store_inspect
from celery_baton.store.inspect import BatchLine, LeaseRow, OrderedLine
from celery_baton.store.schema import hash_tag, owner_parts, parse_rate_override

if TYPE_CHECKING:
    from celery_baton.config import Settings
    from celery_baton.core.batch import BatchPolicy
    from celery_baton.core.keys import KeyNames
    from celery_baton.core.policy.model import TaskPolicy
    from celery_baton.store import Store


class Source(Protocol):
    """Where the operators' views read: the store, its key names, the settings, and the
    app's tasks with a policy (the CLI's ``Context`` is one)."""

    @property
    def store(self) -> Store: ...

    @property
    def names(self) -> KeyNames: ...

    @property
    def settings(self) -> Settings: ...

    def policies(self) -> Mapping[str, tuple[Any, TaskPolicy]]: ...


class Schedules(Protocol):
    """The schedule's listing and operations (``ScheduleStore`` is one)."""

    def describe(self) -> dict[str, Any]: ...

    def pause(self, name: str) -> None: ...

    def resume(self, name: str) -> None: ...

    def trigger(self, name: str) -> None: ...


# -- workers and who holds what ---------------------------------------------------------


def live_workers(source: Source) -> set[str]:
    """The hostnames of the workers that reported to the store within their report ttl."""
    return {r["hostname"] for r in store_inspect.workers(source.store, source.names.prefix)}


def holders(source: Source) -> list[LeaseRow]:
    """Every lease and unique claim; a lease whose worker stopped reporting is stale."""
    live = live_workers(source)
    rows = [
        dataclasses.replace(row, stale=row.worker not in live)
        for row in store_inspect.leases(source.store, source.names.prefix)
    ]
    return rows + store_inspect.unique_claims(source.store, source.names.prefix)


def leases_per_worker(rows: list[LeaseRow]) -> dict[str, int]:
    per_worker: dict[str, int] = {}
    for row in rows:
        per_worker[row.worker] = per_worker.get(row.worker, 0) + 1
    return per_worker


def holders_in_words(owners: list[str], live: set[str]) -> str:
    """Who holds a key, in words (never the owner token ``task|worker|nonce``): a
    unique claim's task, a live run, or a stale lease."""
    parts = []
    for owner in owners:
        task_id, worker, _ = owner_parts(owner)
        if not worker:
            parts.append(f"is claimed by task {task_id} (queued or running)")
        elif worker in live:
            parts.append(
                f"is held by a live run (task {task_id} on {worker}); it is renewed while "
                "that run lives"
            )
        else:
            parts.append(
                f"is held by task {task_id} on {worker}, which stopped reporting: the lease "
                "is STALE and ends when its TTL runs out"
            )
    return "; ".join(parts)


# -- ordered keys and batch keys --------------------------------------------------------


def ordered_keys(source: Source, live: set[str]) -> list[dict[str, Any]]:
    """Each ordered key with a call running or waiting for its turn (``live``: the
    workers that report), as JSON values: see :func:`ordered_entry`."""
    gaps = {name: policy.ordered_gap for name, (_, policy) in source.policies().items()}
    lines = store_inspect.ordered_lines(source.store, source.names.prefix)
    default = source.settings.ordered_gap_timeout
    return [
        ordered_entry(line, gaps.get(line.task, default), live)
        for line in lines
        if line.waiting or line.task_id
    ]


def ordered_entry(line: OrderedLine, gap: float, live: set[str]) -> dict[str, Any]:
    """An ordered key's line as the operator reads it: the position whose turn it is
    (``next``), the calls ``queued`` behind it (positions given after it) and how many of
    them workers hold, the call ``running`` (its lease's holder; None: ``next``'s call has
    not started), and ``skip_in``: the seconds until the gap bound ``gap`` lets the next
    call that asks skip ``next`` (0: overdue, at that call's ask; None: nothing to skip:
    ``next``'s call runs or waits in a worker, or no call is queued behind it)."""
    running = None
    if line.task_id:
        running = {
            "task_id": line.task_id,
            "worker": line.worker,
            "ttl_left": round(line.ttl_left, 3),
            "stale": line.worker not in live,
        }
    skip_in = None
    if running is None and line.queued and not line.next_held:
        skip_in = round(max(0.0, gap - line.gap_clock), 3)
    data = line.as_dict()
    for name in ("task_id", "worker", "ttl_left"):  # in "running"
        del data[name]
    return {
        **data,
        "kind": "ordered",
        "label": ordered_words(line),
        "running": running,
        "gap": gap,
        "skip_in": skip_in,
    }


def gap_words(entry: Mapping[str, Any]) -> str:
    """What an ordered key's ``next`` position does while its call is not running, in
    words after "next N" (:func:`ordered_entry`'s ``entry``; '' when it runs)."""
    if entry["running"] is not None:
        return ""
    if entry["next_held"]:
        return "waits in a worker (never skipped while it asks)"
    if entry["skip_in"] is None:
        return "not started yet (nothing queued behind it)"
    idle = f"not started for {entry['idle']:.1f}s"
    if entry["skip_in"] > 0:
        return f"{idle}: skipped in {entry['skip_in']:.1f}s if its call does not come"
    return f"{idle}, past the gap bound ({entry['gap']:g}s): the next ask skips it"


def ordered_words(line: OrderedLine) -> str:
    """An ordered key in words: from what its first publish wrote, else its lease's."""
    return words(line.key, line.material) if line.material is not None else line.label


def batch_keys(source: Source, live: set[str]) -> list[dict[str, Any]]:
    """Each batch key with calls waiting or a batch running, as JSON values: see
    :func:`batch_entry`."""
    policies = {
        name: policy.batch for name, (_, policy) in source.policies().items() if policy.batch
    }
    return [
        batch_entry(line, policies.get(line.task), live)
        for line in store_inspect.batch_lines(source.store, source.names.prefix)
    ]


def batch_entry(line: BatchLine, batch: BatchPolicy | None, live: set[str]) -> dict[str, Any]:
    """A batch key as the operator reads it: its ``waiting`` calls, the ``oldest``'s age,
    the task's ``size`` and ``wait`` (None: a task this app does not have), ``due_in``:
    the seconds until the next batch of its waiting calls is due (0: due now, claimed at
    the next tick of a worker that holds one of them; None: none waits, or unknown), and
    the batches that ``runs`` now, each with its worker (``stale``: it stopped reporting)."""
    due_in = None
    if line.waiting and batch is not None:
        full = line.waiting >= batch.size
        due_in = 0.0 if full else round(max(0.0, batch.wait - line.oldest), 3)
    data = line.as_dict()
    data["runs"] = [
        {**dataclasses.asdict(run), "stale": run.worker not in live} for run in line.runs
    ]
    return {
        **data,
        "kind": "batch",
        "size": batch.size if batch else None,
        "wait": batch.wait if batch else None,
        "due_in": due_in,
    }


# -- the store itself -------------------------------------------------------------------


def status(source: Source) -> dict[str, Any]:
    """The store (URL, server, round trip, grace, warnings) and the workers with their
    leases, as JSON values (``baton status``)."""
    store = source.store
    rtts = [store.ping() for _ in range(5)]
    info = store.client.info("server")
    rows = store_inspect.leases(store, source.names.prefix)
    reports = store_inspect.workers(store, source.names.prefix)
    version = info.get("valkey_version") or info.get("redis_version")
    per_worker = leases_per_worker(rows)
    live = {r["hostname"] for r in reports}
    data: dict[str, Any] = {
        "store": store.safe_url,
        "embedded": store.embedded,
        "store_from": source.settings.url_source,
        "server": f"{info.get('server_name', 'redis')} {version}",
        "rtt_ms": round(statistics.median(rtts) * 1000, 3),
        "leases": len(rows),
        "stale_leases": sum(1 for row in rows if row.worker not in live),
        "workers": [
            {
                "hostname": r["hostname"],
                "leases": per_worker.get(r["hostname"], 0),
                "held": r.get("held", 0),
                "batched": r.get("batched", 0),  # of "held": calls waiting for a batch
                "admitted": r.get("admitted", 0),
            }
            for r in reports
        ],
    }
    lines = store_inspect.ordered_lines(store, source.names.prefix)
    # Lines with work waiting, or that skipped a missing call: the operator's business.
    data["ordered"] = [
        {**line.as_dict(), "label": ordered_words(line)}
        for line in lines
        if line.waiting or line.skipped
    ]
    data["grace"] = grace(source)
    eviction = store_inspect.eviction_warning(store_inspect.eviction_policy(store))
    data["warnings"] = [eviction] if eviction else []
    return data


def grace(source: Source) -> str:
    """The store's grace after it lost its data, in words ('' when none is in force)."""
    store, prefix = source.store, source.names.prefix
    if store.cluster:  # a grace per task family, held by its shard
        graces = store_inspect.family_graces(store, prefix)
        if not graces:
            return ""
        return (
            f"{len(graces)} task(s) on a shard that lost its data or changed master get no "
            f"new lease for up to {max(graces.values()):.1f}s more: {', '.join(sorted(graces))}"
        )
    age = store_inspect.store_epoch_age(store, prefix)
    longest = max([p.lease_ttl for _, p in source.policies().values() if p.gates_runs] or [0.0])
    if age is None:
        # New or emptied: the first lease dates the store from its start (as the gate
        # does: its uptime less a second), so what is true now follows from the uptime.
        up = max(0, int(store.client.info("server").get("uptime_in_seconds", 0)) - 1)
        if up >= longest:
            return ""
        return (
            f"the store started {up}s ago without its data: no new lease for up to "
            f"{longest - up:.1f}s more (`end-grace` ends it if the store is new)"
        )
    if age < longest:
        return (
            f"the store started, lost its data or changed master {age:.1f}s ago: no new "
            f"lease until each task's lease_ttl has passed since (up to "
            f"{longest - age:.1f}s more; `end-grace` ends it if the store is new)"
        )
    return ""


# -- limits -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TaskLimits:
    """One task's global limits: as declared, as overridden at runtime, and in force."""

    task: str
    #: The declaration in words: ``"2/s burst 1 + 10/s + [api]"``; None: no rate.
    declared_rate: str | None
    declared_concurrency: int | None
    #: The runtime overrides as stored (``baton limits set``), by field.
    overrides: dict[str, str]
    #: In force (the override, else the declaration): (runs per second, burst).
    rate: tuple[float, int] | None
    concurrency: int | None
    #: Its concurrency leases now.
    holders: list[LeaseRow]


def task_limits(source: Source, leases: list[LeaseRow]) -> list[TaskLimits]:
    """The limits of every task with a policy (``leases``: where its holders are found)."""
    rows = []
    for name, (task, policy) in source.policies().items():
        overrides = store_inspect.limit_overrides(source.store, source.names.limits(name))
        rows.append(
            TaskLimits(
                task=name,
                declared_rate=_declared_rate(task, policy),
                declared_concurrency=policy.concurrency.limit if policy.concurrency else None,
                overrides=overrides,
                rate=_rate_in_force(task, policy, overrides.get("rate")),
                concurrency=_concurrency_in_force(policy, overrides.get("concurrency")),
                holders=[r for r in leases if r.task == name and r.kind == "concurrency"],
            )
        )
    return rows


def override_rate(value: str) -> tuple[float, int]:
    """A stored rate override, ``"<interval_us> <burst>"``, as (runs per second, burst)."""
    interval_us, burst = parse_rate_override(value)
    return 1_000_000 / interval_us, burst


def _declared_rate(task: Any, policy: TaskPolicy) -> str | None:
    rate = None
    if policy.rate:
        rate = f"{rate_text(policy.rate.per_second)} burst {policy.rate.burst}"
        for more in policy.more_rates:  # decided in the same call
            rate += f" + {rate_text(more.per_second)}"
    elif policy.rate_from_celery and task.rate_limit:
        rate = f"{task.rate_limit} (Celery rate_limit, global)"
    if policy.shared:  # named limits, decided in the same call
        named = " + ".join(f"[{limit.name}]" for limit in policy.shared)
        rate = f"{rate} + {named}" if rate else named
    return rate


def _rate_in_force(task: Any, policy: TaskPolicy, override: str | None) -> tuple[float, int] | None:
    if override:
        return override_rate(override)
    if policy.rate:
        return policy.rate.per_second, policy.rate.burst
    if policy.rate_from_celery and getattr(task, "rate_limit", None):
        try:
            per_second = parse_rate(task.rate_limit)
        except BatonError:
            return None
        return (per_second, 1) if per_second else None
    return None


def _concurrency_in_force(policy: TaskPolicy, override: str | None) -> int | None:
    if override:
        return int(override) or None
    return (policy.concurrency.limit if policy.concurrency else 0) or None


def limits_in_use(
    source: Source, leases: list[LeaseRow], reports: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Each limit in force with its use now: the part of the rate's burst in use (and
    how long until the next start may pass), concurrency slots in use, and the requests
    workers hold for the task."""
    held: dict[str, int] = {}
    for report in reports:
        for key, count in (report.get("held_by_key") or {}).items():
            task = hash_tag(key)
            held[task] = held.get(task, 0) + int(count)
    rows = []
    for limits in task_limits(source, leases):
        row: dict[str, Any] = {
            "task": limits.task,
            "overrides": limits.overrides,
            "held": held.get(limits.task, 0),
            "rate": None,
            "concurrency": None,
        }
        if limits.rate:
            per_second, burst = limits.rate
            interval = 1_000_000 / per_second
            ahead = store_inspect.rate_ahead_us(source.store, source.names.prefix, limits.task)
            busiest = max(ahead, default=0)
            row["rate"] = {
                "per_second": per_second,
                "burst": burst,
                "keys": len(ahead),
                "burst_in_use": round(min(busiest / interval, burst), 2),
                "next_start_in": round(max(0.0, busiest - (burst - 1) * interval) / 1e6, 3),
            }
        if limits.concurrency:
            per_key = leases_per_key(limits.holders)
            row["concurrency"] = {
                "limit": limits.concurrency,
                "in_use": len(limits.holders),
                "keys": len(per_key),
                "busiest_key": max(per_key.values(), default=0),
            }
        if row["rate"] or row["concurrency"]:
            rows.append(row)
    return rows


def leases_per_key(rows: list[LeaseRow]) -> dict[str, int]:
    per_key: dict[str, int] = {}
    for row in rows:
        per_key[row.key] = per_key.get(row.key, 0) + 1
    return per_key


def named_limits(
    source: Source, policies: Mapping[str, tuple[Any, TaskPolicy]]
) -> list[dict[str, Any]]:
    """``baton_limits``: each limit, its penalty left, and the tasks that draw from it."""
    from celery_baton.core.shared_limits import parse_limits

    rows = []
    for name, limit in parse_limits(source.settings.limits).items():
        users = [t for t, (_, p) in policies.items() if limit in p.shared]
        rows.append(
            {
                "limit": name,
                "rate": rate_text(limit.per_second),
                "burst": limit.burst,
                "penalty_left": store_inspect.penalty_left(
                    source.store, source.names.shared_penalty(name)
                ),
                "tasks": len(users),
            }
        )
    return rows


# -- everything the web view shows ------------------------------------------------------


def collect(source: Source, schedules: Schedules) -> dict[str, Any]:
    """Everything the web page shows, as JSON values (``/api/state``)."""
    store, prefix = source.store, source.names.prefix
    reports = store_inspect.workers(store, prefix)
    ttls = store_inspect.worker_report_ttls(store, prefix)
    rows = holders(source)
    leases = [r for r in rows if r.kind != "unique"]
    claims = [r for r in rows if r.kind == "unique"]
    per_worker = leases_per_worker(leases)
    live = {r.get("hostname", "") for r in reports}
    workers = []
    for report in reports:
        name = report.get("hostname", "")
        workers.append(
            {**report, "leases_in_store": per_worker.get(name, 0), "expires_in": ttls.get(name)}
        )
    return {
        **empty_state(store.safe_url),
        "workers": workers,
        "leases": [r.as_dict() for r in leases],
        "unique_claims": [r.as_dict() for r in claims],
        "limits": limits_in_use(source, leases, reports),
        "ordered": ordered_keys(source, live),
        "batches": batch_keys(source, live),
        "schedule": schedules.describe(),
    }


def empty_state(store_url: str) -> dict[str, Any]:
    """The web view's state with nothing read (the store has not answered yet)."""
    return {
        "store": store_url,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "workers": [],
        "leases": [],
        "unique_claims": [],
        "limits": [],
        "ordered": [],
        "batches": [],
        "schedule": {},
    }
