"""The stores ``scale.py`` drives: one server, or a Redis Cluster of several masters."""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import time
from collections.abc import Sequence

import redis
from redis.crc import key_slot

from celery_baton.store.scripts import SCRIPT_NAMES, script_source
from servers import free_port


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
