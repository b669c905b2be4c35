"""A task's coordination policy, compiled once from its options. Celery-free.

Reads the options as plain attributes (Celery stores ``@app.task(**options)`` on the task
class), validates them, and turns one call into the gate's conditions.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, TypedDict

from celery_baton.config import Settings, suggest
from celery_baton.core import debounce, fairness
from celery_baton.core.call_options import CallOptions
from celery_baton.core.debounce import FlowPolicy
from celery_baton.core.fairness import FairPolicy, check_weights
from celery_baton.core.gate import Condition, HeldClaim, HeldLease
from celery_baton.core.keys import KeyNames, KeySpec, KeySpecValue, digest
from celery_baton.core.rates import interval_us, parse_burst, parse_rate
from celery_baton.core.shared_limits import Cost, SharedLimit, call_cost, parse_limits, resolve
from celery_baton.errors import ConfigError

#: Every task option celery-baton reads (documented in docs/configuration.md).
TASK_OPTIONS = (
    "exclusive",
    "exclusive_conflict",
    "exclusive_wait_timeout",
    "unique",
    "unique_conflict",
    "unique_until",
    "unique_ttl",
    "global_rate_limit",
    "global_rate_limit_key",
    "global_rate_limit_burst",
    "global_concurrency",
    "global_concurrency_key",
    "lease_ttl",
    "redelivery_guard",
    "expected_runtime",
    "fair_key",
    "fair_weights",
    "limits",
    "cost",
    *debounce.OPTIONS,
)


class TaskOptions(TypedDict, total=False):
    """The task options in a form an IDE and mypy can check::

    @app.task(**TaskOptions(exclusive="feed_url", exclusive_conflict="wait"))
    """

    exclusive: KeySpecValue
    exclusive_conflict: Literal["skip", "wait", "replace", "keep_last"]
    exclusive_wait_timeout: float
    unique: KeySpecValue
    unique_conflict: Literal["return", "raise", "replace"]
    unique_until: Literal["finished", "started"]
    unique_ttl: float
    global_rate_limit: str | float | list[str | float]
    global_rate_limit_key: KeySpecValue
    global_rate_limit_burst: int
    global_concurrency: int
    global_concurrency_key: KeySpecValue
    lease_ttl: float
    redelivery_guard: bool
    expected_runtime: float
    fair_key: KeySpecValue
    fair_weights: Mapping[Any, float] | Callable[[Any], float]
    limits: str | list[str]
    cost: float | Callable[..., float]
    debounce: float
    debounce_key: KeySpecValue
    debounce_max_wait: float
    throttle: float
    throttle_key: KeySpecValue
    throttle_mode: Literal["drop", "trailing"]


CONFLICT_POLICIES = ("skip", "wait", "replace", "keep_last")
#: Exclusive policies under which a newer publish supersedes an older one (supersede.py).
SUPERSEDING = ("replace", "keep_last")
#: The header that carries a superseding publish's order (supersede.py).
ORDER_HEADER = "baton_order"
#: The header the beat stamps on every message it sends: the slot it fires (epoch ms).
BEAT_SLOT_HEADER = "baton_beat_slot"
#: A scheduled beat slot's misfire policy, for a worker that held it past the grace:
#: ``{"misfire": "skip"|"latest"|"all", "grace": seconds, "next": the entry's next slot
#: (ms)}`` (worker/misfire.py).
MISFIRE_HEADER = "baton_beat_misfire"
#: The header that names one publish of a message (publish.py stamps it on every publish
#: path; a retry keeps its run's): a copy the broker redelivers carries the same value,
#: a new publish of the same task id (``Task.replace``, a frozen signature sent again,
#: ``apply_async(task_id=...)``) another. The redelivery guard refuses the first only.
PUBLISH_HEADER = "baton_publish"
#: How long a worker remembers that a beat slot's task id ran (seconds). A slot is sent
#: twice only when a leader's publish stalled past its lease, and its copy lands when
#: the broker comes back: a day covers any such stall, at one small key per slot.
BEAT_SLOT_RETENTION = 24 * 3600.0
MAX_RESERVE = 1.0  # seconds
UNIQUE_UNTIL = ("finished", "started")
UNIQUE_CONFLICTS = ("return", "raise", "replace")


@dataclass(frozen=True)
class RatePolicy:
    per_second: float
    burst: int
    key: KeySpec | None

    @property
    def interval_us(self) -> int:
        return interval_us(self.per_second)


@dataclass(frozen=True)
class ConcurrencyPolicy:
    limit: int
    key: KeySpec | None


@dataclass
class RunPlan:
    """What one delivery of a task asks the gate for, and what it must give back."""

    owner: str
    conditions: list[Condition]
    leases: list[HeldLease]
    exclusive_key: str | None = None
    run_key: str | None = None  # the redelivery guard's lease on this task id
    unique_key: str | None = None
    done_key: str | None = None
    done_stamp: str = ""  # the publish this delivery is (PUBLISH_HEADER; '': unstamped)
    # The text each key's digest was made of (a named limit's keys: its name), for the
    # operator: `celery baton locks` and the task events say what a request waits for.
    labels: dict[str, str] = field(default_factory=dict)
    supersede_key: str | None = None  # the publish order of a superseding exclusive key
    superseded_key: str | None = None  # this task id's unique replace marker
    reserve: float = 0.0  # seconds ahead a rate slot may be reserved (see gate.lua)
    # Debounce or throttle: decided (flow_key) before the gate; flow_passed once it ran.
    flow_key: str | None = None
    flow_passed: bool = False
    # fair_key: the local wait queue of each shared limit's key (one per fair key
    # value), and the limit key each "F" condition belongs to.
    fair_queues: dict[str, str] = field(default_factory=dict)
    fair_limits: dict[str, str] = field(default_factory=dict)
    kept_claim: HeldClaim | None = None  # the unique claim its run renews (expiring message)

    def with_owner(self, owner: str) -> RunPlan:
        """The same plan for another owner: a new attempt of the same delivery, whose
        earlier owner's grants (if any) are being given back."""
        leases = [dataclasses.replace(lease, owner=owner) for lease in self.leases]
        return dataclasses.replace(self, owner=owner, leases=leases)


@dataclass(frozen=True)
class TaskPolicy:
    """Compiled options of one task. ``plan()`` builds a delivery's conditions."""

    name: str
    lease_ttl: float
    exclusive: KeySpec | None = None
    exclusive_conflict: str = "skip"
    unique: KeySpec | None = None
    unique_until: str = "finished"
    unique_ttl: float = 3600.0
    rate: RatePolicy | None = None
    # More limits decided in the same call: global_rate_limit=["10/s", "500/h"].
    more_rates: tuple[RatePolicy, ...] = ()
    rate_from_celery: bool = False
    concurrency: ConcurrencyPolicy | None = None
    redelivery_guard: bool = False
    redelivery_retention: float = 86400.0
    exclusive_wait_timeout: float | None = None  # a "wait" duplicate skips after this
    unique_conflict: str = "return"  # a duplicate publish: "return" the first, or "raise"
    # Keys given by the call itself (call_options.py): their material, used as given.
    call_exclusive: str | None = None
    call_unique: str | None = None
    fair: FairPolicy | None = None  # fair_key: a shared limit shared fairly
    # Named limits shared with other tasks (baton_limits), and what one call costs them.
    shared: tuple[SharedLimit, ...] = ()
    cost: Cost | None = None
    flow: FlowPolicy | None = None  # debounce or throttle (debounce.py)

    def for_call(self, call: CallOptions) -> TaskPolicy:
        """This policy as one call's per-call options override it (that call only)."""
        return replace(
            self,
            exclusive=self.exclusive or (_PER_CALL if call.exclusive is not None else None),
            call_exclusive=call.exclusive,
            exclusive_conflict=call.conflict or self.exclusive_conflict,
            exclusive_wait_timeout=call.wait_timeout or self.exclusive_wait_timeout,
            lease_ttl=call.lease_ttl or self.lease_ttl,
            unique=self.unique or (_PER_CALL if call.unique is not None else None),
            call_unique=call.unique,
            unique_conflict=call.unique_conflict or self.unique_conflict,
            unique_ttl=call.unique_ttl or self.unique_ttl,
        )

    @property
    def celery_rate_only(self) -> bool:
        """Whether Celery's runtime ``rate_limit`` is all this task may be gated by: with
        none set, its deliveries skip the gate entirely."""
        return (
            self.rate_from_celery
            and not (self.exclusive or self.concurrency or self.redelivery_guard or self.unique)
            and not self.shared
            and not self.flow
        )

    @property
    def gates_runs(self) -> bool:
        """Whether the worker must pass this task's deliveries through the gate."""
        return bool(
            self.exclusive
            or self.rate
            or self.rate_from_celery
            or self.concurrency
            or self.redelivery_guard
            or self.shared
            or (self.unique and self.unique_until == "started")
            or (self.unique and self.unique_conflict == "replace")
            or self.flow
        )

    @property
    def supersedes(self) -> bool:
        """Whether a newer publish of an exclusive key supersedes an older one."""
        return self.exclusive is not None and self.exclusive_conflict in SUPERSEDING

    def exclusive_digest(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        """The digest naming this call's exclusive key; raises KeySpecError."""
        assert self.exclusive is not None
        if self.call_exclusive is not None:
            return digest(self.call_exclusive)
        return digest(self.exclusive.material(args, kwargs))

    def freed_at_end(self, plan: RunPlan) -> str | None:
        """The unique key ``plan``'s run frees when it ends for good (None: it has none,
        or ``unique_until="started"`` freed it at the start)."""
        return plan.unique_key if self.unique_until == "finished" else None

    def unique_key(self, names: KeyNames, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        assert self.unique is not None
        if self.call_unique is not None:
            return names.unique(self.name, digest(self.call_unique))
        return names.unique(self.name, self.unique.key(args, kwargs))

    def plan(
        self,
        names: KeyNames,
        *,
        task_id: str,
        owner: str,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        celery_rate: float | None = None,
        expires_at: float | None = None,
        redelivered: bool = False,
        now: float | None = None,
        order: int | None = None,
        stamp: str = "",
    ) -> RunPlan:
        """The gate conditions of one delivery; raises KeySpecError for bad arguments.

        ``expires_at`` (wall clock, seconds since the epoch; ``now`` by the same clock):
        the message's expiry. Its unique claim may have been given a ttl as short as that
        (see ``publish``), so the run must extend it; and a copy of it that the broker
        gives back after the run was lost with its worker is discarded once expired, so
        the claim is held by the run's liveness (renewed with its leases) rather than
        for ``unique_ttl``: lost with its worker, it lapses within ``lease_ttl`` (or at
        the expiry, if later), and the next publish is queued.
        ``redelivered``: a copy the broker gave back (after a failed ack its claim was kept
        for the redelivery window only, Releasing.unacked_claim_ttl): its run extends it.
        ``order``: a superseding publish's order (its header; None: the gate gives one).
        ``stamp``: the publish this delivery is (``PUBLISH_HEADER``; '': a message sent
        without celery-baton, judged by its task id alone).
        """
        plan = RunPlan(owner, [], [])
        if self.flow is not None:
            plan.flow_key = self.flow.store_key(names, self.name, args, kwargs)
            flow_key = self.flow.key
            plan.labels[plan.flow_key] = flow_key.material(args, kwargs) if flow_key else ""
        if self.redelivery_guard:
            plan.done_key = names.done(self.name, task_id)
            plan.done_stamp = stamp
            plan.conditions.append(Condition.not_done(plan.done_key, stamp, task_id))
            plan.run_key = names.lease(self.name, "run", task_id)
            self._lease(plan, plan.run_key, 1, fence=False)
        if self.exclusive is not None:
            material = (
                self.call_exclusive
                if self.call_exclusive is not None
                else self.exclusive.material(args, kwargs)
            )
            key = names.lease(self.name, "ex", digest(material))
            plan.exclusive_key = key
            plan.labels[key] = material
            if self.exclusive_conflict in SUPERSEDING:
                # Before the lease: an older publish is superseded whoever holds the key.
                plan.supersede_key = names.supersede(self.name, digest(material))
                plan.labels[plan.supersede_key] = material
                plan.conditions.append(Condition.supersede(plan.supersede_key, order, task_id))
            self._lease(plan, key, 1, fence=True)
        if self.concurrency is not None:
            spec = self.concurrency.key
            material = spec.material(args, kwargs) if spec else ""
            key = names.lease(self.name, "cc", digest(material))
            plan.labels[key] = material
            plan.conditions.append(Condition.override(names.limits(self.name), "concurrency"))
            self._lease(plan, key, self.concurrency.limit, fence=False)
            self._fair(plan, names, "cc", key, args, kwargs)
        rate = self.rate
        if rate is None and celery_rate is not None:
            rate = RatePolicy(celery_rate, 1, None)
        if rate is not None:
            # Reserve up to one interval ahead: a waiter that asks early takes its slot
            # and starts exactly then, so wake-up latency costs no rate.
            plan.reserve = min(1.0 / rate.per_second, MAX_RESERVE)
            material = rate.key.material(args, kwargs) if rate.key else ""
            plan.conditions.append(Condition.override(names.limits(self.name), "rate"))
            plan.conditions.append(
                Condition.rate(
                    names.rate(self.name, digest(material)), rate.interval_us, rate.burst
                )
            )
            plan.labels[plan.conditions[-1].key] = material
            self._fair(plan, names, "rate", plan.conditions[-1].key, args, kwargs)
            for more in self.more_rates:
                # Every limit in the same atomic call: all pass or none is spent. Each
                # has a key of its own (its interval in the name), in the task's family.
                plan.reserve = min(plan.reserve, 1.0 / more.per_second)
                plan.conditions.append(
                    Condition.rate(
                        names.rate(self.name, f"{digest(material)}:{more.interval_us}"),
                        more.interval_us,
                        more.burst,
                    )
                )
                plan.labels[plan.conditions[-1].key] = material
        if self.shared:
            # Last: on Cluster they are asked first, on their own slots (Gate.decide).
            cost = call_cost(self.cost, self.shared, args, kwargs)
            for limit in self.shared:
                ahead = min(limit.increment_us(cost) / 1e6, MAX_RESERVE)
                plan.reserve = min(plan.reserve, ahead) if plan.reserve else ahead
                plan.conditions += limit.conditions(names, cost)
                # A named limit's keys are labelled with its name (worker/events.py).
                plan.labels[names.shared_rate(limit.name)] = limit.name
                plan.labels[names.shared_penalty(limit.name)] = limit.name
        if self.unique is not None:
            plan.unique_key = self.unique_key(names, args, kwargs)
            if self.unique_conflict == "replace":
                plan.superseded_key = names.superseded(self.name, task_id)
                plan.conditions.append(
                    Condition.not_superseded(plan.superseded_key, self.unique_ttl)
                )
            if self.unique_until == "started":
                plan.conditions.append(Condition.free_unique(plan.unique_key, task_id))
            elif expires_at is not None:
                # Held while the run lives (renewed with its leases), whatever ttl the
                # publish gave the claim; a task with no other condition makes the call
                # for it.
                claim = HeldClaim(plan.unique_key, task_id, self.lease_ttl, expires_at)
                plan.kept_claim = claim
                ttl = claim.ttl_from(time.time() if now is None else now)
                plan.conditions.append(Condition.keep_unique(plan.unique_key, task_id, ttl))
            elif plan.conditions or redelivered:
                # Held until the run finishes, in the call made anyway (the claim's ttl
                # from the publish is unique_ttl: no expiry cut it), or made for it.
                plan.conditions.append(
                    Condition.keep_unique(plan.unique_key, task_id, self.unique_ttl)
                )
        return plan

    def _fair(
        self,
        plan: RunPlan,
        names: KeyNames,
        kind: str,
        limit_key: str,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
    ) -> None:
        """fair_key: the "F" condition right after the shared limit's own (gate.lua)."""
        if self.fair is None:
            return
        value, fair_digest = self.fair.value(args, kwargs)
        base = names.fair(self.name, kind, limit_key.rsplit(":", 1)[-1])
        plan.conditions += fairness.conditions(base, fair_digest, self.fair.stride(value))
        plan.fair_queues[limit_key] = f"{limit_key}#{fair_digest}"
        plan.fair_limits[base] = limit_key

    def _lease(self, plan: RunPlan, key: str, limit: int, *, fence: bool) -> None:
        plan.conditions.append(Condition.lease(key, limit=limit, fence=fence))
        plan.leases.append(HeldLease(key, plan.owner, limit, self.lease_ttl))


#: The key spec of an option that only a call gives (its material comes with the call).
_PER_CALL = KeySpec("per-call", None, (), whole_task=True)


def policy_for_call(
    policy: TaskPolicy | None, name: str, call: CallOptions, settings: Settings
) -> TaskPolicy:
    """The policy one call runs under: the task's (or none) with the call's options."""
    if policy is None:
        policy = TaskPolicy(
            name=name,
            lease_ttl=settings.lease_ttl,
            unique_ttl=settings.unique_ttl,
            redelivery_guard=settings.redelivery_guard,
            redelivery_retention=settings.redelivery_retention,
        )
    return policy.for_call(call)


def run_once(policy: TaskPolicy | None, name: str, settings: Settings) -> TaskPolicy:
    """``policy`` (or no policy at all) with the redelivery guard on: how a worker admits
    a beat slot. A broker cannot be fenced, so a slot may be *sent* twice (a stalled
    publish lands after the next leader re-sent it, under the same task id); the guard's
    run lease and done marker make it *run* once, whatever the task's own options and
    ``baton_redelivery_guard`` say."""
    if policy is None:
        return TaskPolicy(
            name=name,
            lease_ttl=settings.lease_ttl,
            redelivery_guard=True,
            redelivery_retention=BEAT_SLOT_RETENTION,
        )
    retention = max(policy.redelivery_retention, BEAT_SLOT_RETENTION)
    if policy.redelivery_guard and policy.redelivery_retention == retention:
        return policy
    return replace(policy, redelivery_guard=True, redelivery_retention=retention)


def declares_options(options: Mapping[str, Any]) -> bool:
    return any(options.get(name) is not None for name in TASK_OPTIONS)


#: Options that only mean something beside another one.
NEEDS = {
    "exclusive_conflict": "exclusive",
    "exclusive_wait_timeout": "exclusive",
    "unique_conflict": "unique",
    "unique_until": "unique",
    "unique_ttl": "unique",
    "global_rate_limit_burst": "global_rate_limit",
    "global_rate_limit_key": "global_rate_limit",
    "global_concurrency_key": "global_concurrency",
    "fair_weights": "fair_key",
    "cost": "limits",
}


def check_option_names(name: str, options: Mapping[str, Any], others: Iterable[str]) -> None:
    """A task option that is not ours but close to one of ours is a typo
    (``exclusiv="feed_url"``): refuse it with a suggestion, every such option at once.
    ``others``: names that are somebody else's (Celery's own task attributes and publish
    options, the task's base class's attributes, other extensions' options)."""
    others = set(others)
    typos = []
    for option in options:
        if option in TASK_OPTIONS or option in others:
            continue
        if option == "fair":  # fair=True says fair, but not by what
            typos.append(
                "`fair`: name the key that shares the limit fairly, e.g. fair_key='tenant' "
                "(did you mean `fair_key`?)"
            )
            continue
        hint = suggest(option, TASK_OPTIONS)
        if hint:
            typos.append(f"`{option}`{hint}")
    if typos:
        plural = "s" if len(typos) > 1 else ""
        raise ConfigError(f"unknown task option{plural} {'; '.join(typos)}", subject=name)


def compile_policy(
    name: str,
    options: Callable[[str], Any],
    fun: Callable[..., Any],
    settings: Settings,
    *,
    bound: bool = False,
) -> TaskPolicy | None:
    """Validate a task's options; ``None`` when it asks for nothing.

    ``options(name)`` reads one option (``getattr`` on the task, or a dict lookup at
    declaration time); ``fun`` is the function whose signature keys are bound to.
    """

    def spec(option: str) -> KeySpec | None:
        value: KeySpecValue | None = options(option)
        if value is None or value is False:
            return None
        return KeySpec.build(value, fun, subject=f"{name}.{option}", bound=bound)

    def choice(option: str, allowed: tuple[str, ...]) -> str:
        value = options(option)
        value = allowed[0] if value is None else value
        if value not in allowed:
            hint = suggest(value, allowed) if isinstance(value, str) else ""
            raise ConfigError(
                f"must be one of {allowed}, got {value!r}{hint}", subject=f"{name}.{option}"
            )
        return str(value)

    def seconds(option: str, default: float) -> float:
        value = options(option)
        if value is None:
            return default
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not value > 0
            or math.isinf(value)  # forever is leaving the option out, or a bug
        ):
            raise ConfigError(
                f"must be a number of seconds > 0 and finite, got {value!r}",
                subject=f"{name}.{option}",
            )
        return float(value)

    for option, needed in NEEDS.items():
        if options(option) is not None and options(needed) is None:
            raise ConfigError(f"{option} needs {needed}", subject=name)

    rate = None
    more_rates: tuple[RatePolicy, ...] = ()
    if options("global_rate_limit") is not None:
        subject = f"{name}.global_rate_limit"
        burst = parse_burst(
            1 if options("global_rate_limit_burst") is None else options("global_rate_limit_burst"),
            subject=f"{subject}_burst",
        )
        key = spec("global_rate_limit_key")
        limits = options("global_rate_limit")
        if isinstance(limits, list | tuple):
            if not limits:
                raise ConfigError("an empty list of rates", subject=subject)
            rates = [parse_rate(x, subject=f"{subject}[{i}]") for i, x in enumerate(limits)]
            if len(set(rates)) != len(rates):
                raise ConfigError(f"the same rate twice in {limits!r}", subject=subject)
        else:
            rates = [parse_rate(limits, subject=subject)]
        rate = RatePolicy(rates[0], burst, key)
        more_rates = tuple(RatePolicy(r, burst, key) for r in rates[1:])

    concurrency = None
    limit = options("global_concurrency")
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ConfigError(
                f"must be an int >= 1, got {limit!r}", subject=f"{name}.global_concurrency"
            )
        concurrency = ConcurrencyPolicy(limit, spec("global_concurrency_key"))

    fair = _fair_policy(name, options, spec)
    shared = _shared_limits(name, options, settings)
    flow = debounce.compile_flow(name, options, spec)

    if options("exclusive_wait_timeout") is not None and (
        options("exclusive_conflict") or "skip"
    ) in ("replace", "skip"):
        # "skip" drops a duplicate at once, "replace" stops the old run: nothing waits.
        raise ConfigError(
            "exclusive_wait_timeout does nothing with exclusive_conflict="
            f'"{options("exclusive_conflict") or "skip"}" (nothing waits); use "wait" or '
            '"keep_last" for a bounded wait',
            subject=name,
        )
    conflict = options("exclusive_conflict")
    if (
        conflict in SUPERSEDING
        and options("unique") is not None
        and options("unique") == options("exclusive")
        and options("unique_until") != "started"
        and options("unique_conflict") != "replace"
    ):
        # The newer publish would be dropped at publish: it could never supersede.
        raise ConfigError(
            f'exclusive_conflict="{conflict}" with unique on the same key: a newer publish '
            "is de-duplicated before it can supersede the older one; add "
            'unique_conflict="replace" (or unique_until="started", or drop unique)',
            subject=name,
        )
    guard = options("redelivery_guard")
    if settings.global_rate_limits and options("rate_limit"):
        parse_rate(options("rate_limit"), subject=f"{name}.rate_limit")
    policy = TaskPolicy(
        name=name,
        lease_ttl=seconds("lease_ttl", settings.lease_ttl),
        exclusive=spec("exclusive"),
        exclusive_conflict=choice("exclusive_conflict", CONFLICT_POLICIES),
        exclusive_wait_timeout=(
            seconds("exclusive_wait_timeout", 1.0)
            if options("exclusive_wait_timeout") is not None
            else None
        ),
        unique=spec("unique"),
        unique_conflict=choice("unique_conflict", UNIQUE_CONFLICTS),
        unique_until=choice("unique_until", UNIQUE_UNTIL),
        unique_ttl=seconds("unique_ttl", settings.unique_ttl),
        rate=rate,
        more_rates=more_rates,
        # Every task, not only those declared with a rate_limit: `celery control
        # rate_limit` can give any task one at runtime, and Celery's own bucket is off.
        rate_from_celery=settings.global_rate_limits and rate is None,
        concurrency=concurrency,
        redelivery_guard=settings.redelivery_guard if guard is None else bool(guard),
        redelivery_retention=settings.redelivery_retention,
        fair=fair,
        shared=shared,
        cost=options("cost"),
        flow=flow,
    )
    if not (policy.gates_runs or policy.unique):
        return None
    return policy


def _fair_policy(
    name: str, options: Callable[[str], Any], spec: Callable[[str], KeySpec | None]
) -> FairPolicy | None:
    """``fair_key`` (and ``fair_weights``): one shared limit, shared fairly by the key's
    values. A per-key limit (``global_concurrency_key``) is a cap of each key's own;
    ``fair_key`` shares one cap among keys, so it needs a limit to share."""
    if options("fair_key") is None:
        return None
    if options("global_concurrency") is None and options("global_rate_limit") is None:
        raise ConfigError(
            "fair_key shares a limit fairly: it needs global_concurrency or global_rate_limit",
            subject=name,
        )
    key = spec("fair_key")
    if key is None or key.whole_task:
        raise ConfigError(
            "fair_key must name what the limit is shared by (an argument name, a list, "
            "a '{template}' or a callable), not True/False",
            subject=f"{name}.fair_key",
        )
    return FairPolicy(key, check_weights(options("fair_weights"), f"{name}.fair_weights"))


def _shared_limits(
    name: str, options: Callable[[str], Any], settings: Settings
) -> tuple[SharedLimit, ...]:
    """A task's ``limits=`` and ``cost=``, checked against ``baton_limits`` when known
    (at worker start always; at declaration when the app's conf already has them)."""
    wanted, cost = options("limits"), options("cost")
    if cost is not None and not callable(cost):
        SharedLimit("-", 1.0, 1 << 62).check_cost(cost, subject=f"{name}.cost")
    if wanted is None or settings.limits is None:
        return ()
    table = parse_limits(settings.limits)
    shared = resolve(table, wanted, subject=f"{name}.limits")
    if cost is not None and not callable(cost):
        for limit in shared:
            limit.check_cost(cost, subject=f"{name}.cost")
    return shared
