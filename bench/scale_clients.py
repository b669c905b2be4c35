"""The client processes of ``scale.py`` and one measurement: pipelined batches
against a store, its CPU seconds before and after."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import hiredis

from scale_stores import Store
from scale_workloads import Unit, Workload, build_units

BATCH = 64  # tasks per pipelined write
LANES = 3  # client processes (one connection per server each)


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
