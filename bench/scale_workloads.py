"""The workloads of ``scale.py``: the packed store calls of one task of each feature
(built by the library itself), and the anchors' calls recorded from their public API."""

from __future__ import annotations

import importlib.metadata
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import hiredis
import redis

from celery_baton.beat.state import BeatState, Claim
from celery_baton.core.gate import Release, gate_call
from celery_baton.core.keys import KeyNames, KeySpec, given_back
from celery_baton.core.policy.model import ConcurrencyPolicy, RatePolicy, TaskPolicy
from celery_baton.core.policy.plan import plan_delivery
from celery_baton.store import connect
from celery_baton.store.scripts import evalsha_command
from common import import_package
from scale_stores import Store

HIGH = 1_000_000  # per second: a rate that never binds in these runs
TASK_NAMES = 300  # distinct task names: hash tags that spread over a cluster's masters
TASKS_PER_LANE = 2048  # distinct tasks (keys, owners) each connection cycles through
LEASE_TTL = 30.0


def version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


# -- what one task asks of the store ---------------------------------------------------------


@dataclass
class Unit:
    """The packed calls of one task (or one anchor decision), for one node."""

    node: int
    data: bytes
    replies: int
    checked: tuple[int, ...] = ()  # indexes of replies that must be a grant ({1, ...})


def _noop(key: str) -> None:  # the signature the key specs bind to
    pass


def task_policy(feature: str, name: str) -> TaskPolicy:
    spec = KeySpec.build("key", _noop, subject=name)
    options: dict[str, Any] = {}
    if feature in ("exclusive", "all3"):
        options["exclusive"] = spec
    if feature in ("concurrency", "all3"):
        # above the number of leases in flight at once (one per connection and task name)
        options["concurrency"] = ConcurrencyPolicy(1000, None)
    if feature in ("rate", "all3"):
        options["rate"] = RatePolicy(float(HIGH), 1, None)
    if feature == "unique":
        options["unique"] = spec
    return TaskPolicy(name, lease_ttl=LEASE_TTL, **options)


def pack(*commands: Sequence[Any]) -> bytes:
    return b"".join(hiredis.pack_command(tuple(c)) for c in commands)


def task_units(feature: str, store: Store, lane: int, count: int) -> list[Unit]:
    """``count`` tasks of ``feature`` for connection ``lane``: keys of its own (no two
    connections contend), over many task names (many hash tags)."""
    names = KeyNames()
    policies: dict[str, TaskPolicy] = {}
    units = []
    for i in range(count):
        task = f"bench.task{i % TASK_NAMES}"
        policy = policies.get(task) or policies.setdefault(task, task_policy(feature, task))
        task_id = f"t{lane}-{i}"
        owner = f"{task_id}|bench-{lane}|{i}"
        args = (f"{lane}-{i}",)
        plan = plan_delivery(policy, names, task_id=task_id, owner=owner, args=args, kwargs={})
        commands: list[tuple[Any, ...]] = []
        checked: tuple[int, ...] = ()
        if feature == "unique":
            assert plan.unique_key is not None
            ttl_ms = round(policy.unique_ttl * 1000)
            keys = [plan.unique_key, given_back(plan.unique_key, task_id)]
            commands.append(evalsha_command("unique_claim", keys, [task_id, ttl_ms]))
        else:
            keys, argv = gate_call(plan.conditions, owner, policy.lease_ttl, plan.reserve)
            commands.append(evalsha_command("gate", keys, argv))
            checked = (0,)
        unique_key = plan.unique_key if feature == "unique" else None
        if plan.leases or unique_key:
            release = Release(
                tuple(lease.key for lease in plan.leases),
                owner,
                unique_key=unique_key,
                unique_owner=task_id if unique_key else "",
            )
            keys, argv = release.script_call(names.notice_channel)
            commands.append(evalsha_command("release", keys, argv))
        key = (plan.unique_key or plan.conditions[-1].key) if commands else ""
        units.append(Unit(store.node_of(key), pack(*commands), len(commands), checked))
    return units


class _Recorder:
    """Stands in for a pipeline: returns the EVALSHA command instead of sending it."""

    def evalsha(self, sha: str, numkeys: int, *keys_and_args: Any) -> tuple[Any, ...]:
        return ("EVALSHA", sha, numkeys, *keys_and_args)


def beat_units(store: Store, lane: int, count: int) -> list[Unit]:
    """``count`` slot claims of the beat leader (beat_claim + beat_sent each), over
    ``count // 2`` entries of this lane. Each entry's next slot swings between two
    values (A -> B, then B -> A): the script checks only that the expected slot is the
    stored one, so the claims can be replayed forever at the cost of real ones."""
    node = store.nodes[0]
    state = BeatState(connect(node.url))
    lead = state.lead(f"bench-beat-{lane}", 3_600_000)
    if not lead.leading:  # another lane leads: take its token (one leader for all)
        with node.client() as r:
            owner = str(r.hget(state.keys.leader, "owner"))
    else:
        owner = f"bench-beat-{lane}"
    fence = lead.fence
    entries = max(1, count // 2)
    slot_a, slot_b = 1_700_000_000_000, 1_700_000_060_000
    for e in range(entries):
        name = f"entry-{lane}-{e}"
        fields = {"source": "config", "task": "bench.noop", "def": json.dumps({"every": 60})}
        state.define(
            owner=owner,
            fence=fence,
            mode="sync",
            name=name,
            fingerprint="fp",
            next_slot=slot_a,
            edited_line="",
            history_max=20,
            fields=fields,
        )
    units = []
    recorder = _Recorder()
    for expected, new in ((slot_a, slot_b), (slot_b, slot_a)):
        for e in range(entries):
            name = f"entry-{lane}-{e}"
            task_id = f"{name}-{expected}"
            payload = json.dumps({"entry": name, "slot": expected, "kind": "fired"})
            line = json.dumps({"at": expected, "kind": "fired", "slot": expected, "id": task_id})
            claim = Claim(
                name=name,
                expected_next=expected,
                fingerprint="fp",
                new_next=new,
                trigger="",
                last_slot=expected,
                last_id=task_id,
                expected_last="*",
                outbox=[(task_id, payload)],
                history=[line],
                fired=1,
                missed=0,
                suppressed=0,
            )
            claim_cmd = state.claim(owner, fence, claim, 20, recorder)
            sent_cmd = evalsha_command("beat_sent", [state.keys.outbox], [task_id])
            units.append(Unit(0, pack(claim_cmd, sent_cmd), 2, (0,)))
    return units


class _Tee(redis.Connection):
    """A redis-py connection that keeps a copy of what it writes (to replay an anchor's
    exact calls)."""

    log: list[bytes] = []  # one recording at a time, per process
    on = False

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        if _Tee.on:
            chunks = [command] if isinstance(command, bytes | str) else command
            _Tee.log.append(b"".join(c.encode() if isinstance(c, str) else c for c in chunks))
        super().send_packed_command(command, check_health)


def recorded_units(call: Callable[[int], object], count: int) -> list[Unit]:
    """Run ``call(i)`` for real ``count`` times and keep the bytes each wrote."""
    call(-1)  # connects, loads scripts: not part of a decision
    units = []
    for i in range(count):
        _Tee.log, _Tee.on = [], True
        try:
            call(i)
        finally:
            _Tee.on = False
        data = b"".join(_Tee.log)
        reader = hiredis.Reader()
        reader.feed(data)  # a request parses as arrays: one per command
        replies = 0
        while reader.gets() is not False:
            replies += 1
        units.append(Unit(0, data, replies))
    return units


def tee_client(url: str) -> redis.Redis:
    pool = redis.ConnectionPool.from_url(url, connection_class=_Tee)
    return redis.Redis(connection_pool=pool)


def anchor_units(kind: str, url: str, lane: int, count: int) -> list[Unit]:
    if kind == "PING":
        return [Unit(0, pack(("PING",)), 1) for _ in range(count)]
    if kind.startswith("limits"):
        limits = import_package("limits")
        strategies = import_package("limits.strategies")
        storage = import_package("limits.storage").RedisStorage(url, connection_class=_Tee)
        item = limits.RateLimitItemPerSecond(HIGH)
        cls = strategies.MovingWindowRateLimiter
        if kind == "limits-fixed":
            cls = strategies.FixedWindowRateLimiter
        limiter = cls(storage)
        return recorded_units(lambda i: limiter.hit(item, f"bench-{lane}-{i}"), count)
    from dramatiq.rate_limits import BucketRateLimiter, ConcurrentRateLimiter, WindowRateLimiter
    from dramatiq.rate_limits.backends import RedisBackend

    backend = RedisBackend(client=tee_client(url))
    made: dict[int, Any] = {}

    def limiter(i: int) -> Any:
        # a few keys hit again and again: the steady state (a bucket's or a key's
        # first call takes a cheaper path)
        key = f"bench-{lane}-{i % 8}"
        if i not in made:
            if kind == "dramatiq-bucket":
                made[i] = BucketRateLimiter(backend, key, limit=HIGH, bucket=1000)
            elif kind == "dramatiq-window":
                made[i] = WindowRateLimiter(backend, key, limit=HIGH, window=1)
            else:
                made[i] = ConcurrentRateLimiter(backend, key, limit=1000)
        return made[i]

    def acquire(i: int) -> None:
        with limiter(i).acquire(raise_on_failure=False) as acquired:
            if not acquired:
                raise RuntimeError(f"{kind} refused")

    return recorded_units(acquire, count)


@dataclass(frozen=True)
class Workload:
    key: str
    label: str
    baton: bool = True  # built by celery-baton (spreads over a cluster by hash tag)


WORKLOADS = [
    Workload("PING", "PING", baton=False),
    Workload("exclusive", "exclusive (gate + release)"),
    Workload("concurrency", "concurrency (gate + release)"),
    Workload("rate", "rate (gate)"),
    Workload("all3", "rate + concurrency + exclusive (gate + release)"),
    Workload("unique", "unique (claim at publish + release)"),
    Workload("beat", "beat: one slot (beat_claim + beat_sent)"),
    Workload("limits-moving", f"limits {version('limits')} moving window hit()", baton=False),
    Workload("limits-fixed", f"limits {version('limits')} fixed window hit()", baton=False),
    Workload("dramatiq-bucket", f"dramatiq {version('dramatiq')} Bucket acquire", baton=False),
    Workload("dramatiq-window", f"dramatiq {version('dramatiq')} Window acquire", baton=False),
    Workload(
        "dramatiq-concurrent",
        f"dramatiq {version('dramatiq')} Concurrent acquire+release",
        baton=False,
    ),
]


def build_units(workload: Workload, store: Store, lane: int) -> list[Unit]:
    if workload.key == "beat":
        return beat_units(store, lane, 512)
    if workload.baton:
        return task_units(workload.key, store, lane, TASKS_PER_LANE)
    count = 256 if workload.key.startswith("dramatiq") else 512
    if workload.key == "PING":
        count = TASKS_PER_LANE
    return anchor_units(workload.key, store.nodes[0].url, lane, count)
