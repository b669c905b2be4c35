"""Production store topologies for tests: a real Redis Cluster and a real Sentinel setup.

Example::

    cluster = ClusterTopology()          # 3 masters, 1 replica each, node timeout 1 s
    cluster.start()
    cluster.url()                        # redis+cluster://127.0.0.1:PORT/0
    victim = cluster.master_of("baton:{beat:beat_app}:leader")
    victim.kill()                        # SIGKILL; its replica takes over in ~2 s
    cluster.wait_healthy()               # restarts what is down, waits for state ok
    cluster.close()

    sentinel = SentinelTopology()        # 1 master, 1 replica, 3 sentinels
    sentinel.start()
    sentinel.url()                       # sentinel://127.0.0.1:P1,...:P3/baton
    sentinel.failover()                  # SENTINEL FAILOVER baton
    sentinel.close()

Every node is a :class:`~tests.support.servers.StoreServer`, so each can be killed,
paused and restarted on its own port with its own data (a restarted cluster node keeps
its ``nodes.conf`` and rejoins; a restarted old master is turned into a replica by the
sentinels). Both need ``redis-server`` and ``redis-cli`` on PATH (Sentinel also
``redis-sentinel``): :func:`missing_binaries` says what is absent, for a skip reason.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from collections.abc import Callable
from typing import Any

import redis
import redis.cluster
from redis.backoff import NoBackoff
from redis.retry import Retry

from tests.support.servers import StoreServer, free_port

#: Cluster nodes declare a peer failed after this long without an answer (ms). Small,
#: so that a killed master's replica is promoted within a few seconds.
CLUSTER_NODE_TIMEOUT_MS = 1000
#: Sentinels declare a master down after this long without an answer (ms).
SENTINEL_DOWN_AFTER_MS = 1000
SERVICE = "baton"
#: A cluster master that started less than this long ago (s) gives a task family
#: without an epoch a grace (gate.lua, "E"): it ends a lease_ttl after the master's
#: start, read from its uptime in whole seconds (up to 1 s late). The longest lease_ttl
#: the tests use on the cluster (9 s; the default is 8 s), that second and a margin.
YOUNG_S = 12


def missing_binaries(*names: str) -> list[str]:
    """The executables among ``names`` that are not on PATH."""
    return [name for name in names if shutil.which(name) is None]


def _wait(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except (redis.RedisError, OSError) as exc:
            last = exc
        time.sleep(0.1)
    raise TimeoutError(f"{what} not reached within {timeout} s (last error: {last!r})")


def _client(port: int) -> redis.Redis:
    return redis.Redis(
        host="127.0.0.1",
        port=port,
        decode_responses=True,
        socket_connect_timeout=2,
        socket_timeout=5,
        retry=Retry(NoBackoff(), 0),
    )


class ClusterNode(StoreServer):
    """A ``redis-server`` in cluster mode; its bus port is chosen free too (not port+10000,
    which may be above 65535 or taken)."""

    def __init__(self, name: str) -> None:
        self.bus_port = free_port()
        super().__init__(
            name=name,
            extra_args=[
                "--cluster-enabled", "yes",
                "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(CLUSTER_NODE_TIMEOUT_MS),
                # A replica may take over whatever its lag: the test kills masters on
                # purpose, and a replica refusing to be promoted would only hide that.
                "--cluster-replica-validity-factor", "0",
            ],
        )  # fmt: skip

    def _command(self) -> list[str]:
        extra = ["--enable-debug-command", "local"] if _debug_needs_enabling(self.binary) else []
        return [*super()._command(), "--cluster-port", str(self.bus_port), *extra]

    def uptime(self) -> int:
        """Seconds since the server started."""
        with _client(self.port) as r:
            return int(r.info("server")["uptime_in_seconds"])

    def promoted(self) -> bool:
        """Whether it was promoted from a replica since it started (a second replication
        id: the gate then gives a family without an epoch a grace, gate.lua "E")."""
        with _client(self.port) as r:
            return str(r.info("replication").get("master_replid2", "0")).strip("0") != ""

    def info(self) -> dict[str, str]:
        """``CLUSTER INFO`` as a dict."""
        with _client(self.port) as r:
            raw = r.execute_command("CLUSTER", "INFO")
        text = raw if isinstance(raw, str) else raw.decode()
        return dict(line.split(":", 1) for line in text.split() if ":" in line)

    def role(self) -> str:
        """``master`` or ``slave``."""
        with _client(self.port) as r:
            return str(r.execute_command("ROLE")[0])


class ClusterTopology:
    """``masters`` masters with one replica each, created with ``redis-cli --cluster``."""

    def __init__(self, masters: int = 3) -> None:
        self.nodes = [ClusterNode(f"cluster{i}") for i in range(masters * 2)]

    def start(self) -> None:
        for node in self.nodes:
            node.start()
        addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
        subprocess.run(
            ["redis-cli", "--cluster", "create", *addresses, "--cluster-replicas", "1",
             "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=60,
        )  # fmt: skip
        self.wait_healthy()

    def url(self) -> str:
        """``redis+cluster://127.0.0.1:PORT/0`` (any node; the client finds the others)."""
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}/0"

    def client(self) -> redis.cluster.RedisCluster:
        """A new cluster client (``decode_responses=True``); the caller closes it."""
        return redis.cluster.RedisCluster(
            startup_nodes=[redis.cluster.ClusterNode("127.0.0.1", n.port) for n in self.nodes],
            decode_responses=True,
            socket_timeout=5,
            socket_connect_timeout=2,
        )

    def masters(self) -> list[ClusterNode]:
        """The running nodes that are masters now."""
        found = []
        for node in self.nodes:
            if node.is_running:
                with contextlib.suppress(redis.RedisError):
                    if node.role() == "master":
                        found.append(node)
        return found

    def master_of(self, key: str) -> ClusterNode:
        """The running master that serves ``key``'s slot now."""
        for node in self.masters():
            with _client(node.port) as r:
                slot = int(r.execute_command("CLUSTER", "KEYSLOT", key))
                for start, end, master, *_ in r.execute_command("CLUSTER", "SLOTS"):
                    if start <= slot <= end and int(master[1]) == node.port:
                        return node
        raise LookupError(f"no running master serves {key!r}")

    def replica_of(self, master: ClusterNode) -> ClusterNode:
        """The running node that replicates ``master`` now."""
        with _client(master.port) as r:
            replicas = r.execute_command("ROLE")[2]
        ports = {int(entry[1]) for entry in replicas}
        for node in self.nodes:
            if node.port in ports:
                return node
        raise LookupError(f"{master!r} has no replica")

    def healthy(self) -> bool:
        """Every node runs and says ``cluster_state:ok``; every master has a replica
        whose link is up."""
        if not all(node.is_running for node in self.nodes):
            return False
        if any(node.info().get("cluster_state") != "ok" for node in self.nodes):
            return False
        masters = self.masters()
        if len(masters) * 2 != len(self.nodes):
            return False
        for master in masters:
            with _client(master.port) as r:
                if len(r.execute_command("ROLE")[2]) != 1:
                    return False
        return all(
            node.info().get("cluster_known_nodes") == str(len(self.nodes)) for node in self.nodes
        )

    def wait_healthy(self, timeout: float = 60) -> None:
        """Resume/restart every node that is paused or down, then wait for :meth:`healthy`."""
        for node in self.nodes:
            node.resume()
            if not node.is_running:
                node.start()
        _wait(self.healthy, timeout, "a healthy cluster")

    def flushall(self) -> None:
        """FLUSHALL on every master (replicas follow), and make the cluster look known new
        to the gate, as StoreServer.flushall does for one server.

        On Cluster the gate cannot tell a family never used from one its shard forgot,
        so it asks the server (gate.lua, "E"): a master that started less than a
        lease_ttl ago, or was promoted from a replica, gives every family without an
        epoch a grace. So a young master hands its slots to its replica when that one
        is older (``CLUSTER FAILOVER``, which waits for the replica to catch up), a
        promoted master's second replication id is cleared (``DEBUG CHANGE-REPL-ID``,
        a test-only command: the history starts over), and a cluster that only just
        started waits until it is :data:`YOUNG_S` old.
        """
        for master in self.masters():
            if master.uptime() < YOUNG_S:
                replica = self.replica_of(master)
                if replica.uptime() >= YOUNG_S:
                    with _client(replica.port) as r:
                        r.execute_command("CLUSTER", "FAILOVER")
                    _wait(lambda m=master: m.role() == "slave", 30, "the failover to the replica")
                    self.wait_healthy()
        masters = self.masters()
        time.sleep(max(0, YOUNG_S - min(m.uptime() for m in masters)))
        for master in masters:
            master.flushall()
            if master.promoted():
                with _client(master.port) as r:
                    r.execute_command("DEBUG", "CHANGE-REPL-ID")

    def close(self) -> None:
        for node in self.nodes:
            node.close()


class SentinelServer(StoreServer):
    """A ``redis-sentinel`` process watching one master, from a config file it may rewrite."""

    def __init__(self, name: str, master_port: int, quorum: int) -> None:
        super().__init__(name=name, persistent=False)
        self.config_path = self.data_dir / "sentinel.conf"
        self.config_path.write_text(
            f"port {self.port}\n"
            "bind 127.0.0.1\n"
            "protected-mode no\n"
            f"dir {self.data_dir}\n"
            f"logfile {self.log_path}\n"
            f"sentinel monitor {SERVICE} 127.0.0.1 {master_port} {quorum}\n"
            f"sentinel down-after-milliseconds {SERVICE} {SENTINEL_DOWN_AFTER_MS}\n"
            f"sentinel failover-timeout {SERVICE} 5000\n"
            f"sentinel parallel-syncs {SERVICE} 1\n"
        )
        self._binary = shutil.which("redis-sentinel") or "redis-sentinel"

    def _command(self) -> list[str]:
        return [self._binary, str(self.config_path)]

    def master_port(self) -> int:
        """The port of the master this sentinel names now."""
        with _client(self.port) as r:
            _, port = r.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
        return int(port)


class SentinelTopology:
    """1 master, 1 replica and 3 sentinels (quorum 2) for the service ``baton``."""

    def __init__(self) -> None:
        master = StoreServer(name="sentinel-data0")
        replica = StoreServer(name="sentinel-data1")
        replica.extra_args = ["--replicaof", "127.0.0.1", str(master.port)]
        self.data = [master, replica]
        self.sentinels = [SentinelServer(f"sentinel{i}", master.port, 2) for i in range(3)]

    def start(self) -> None:
        for server in (*self.data, *self.sentinels):
            server.start()
        self.wait_healthy()

    def url(self, db: int = 0) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"sentinel://{hosts}/{SERVICE}/{db}"

    def master(self) -> StoreServer:
        """The data server the sentinels name as master now (asks a running sentinel)."""
        for sentinel in self.sentinels:
            if sentinel.is_running:
                with contextlib.suppress(redis.RedisError):
                    port = sentinel.master_port()
                    return next(s for s in self.data if s.port == port)
        raise LookupError("no sentinel answers")

    def replica(self) -> StoreServer:
        master = self.master()
        return next(s for s in self.data if s is not master)

    def failover(self) -> None:
        """``SENTINEL FAILOVER baton`` (a planned switch: the replica becomes master)."""
        with _client(self.sentinels[0].port) as r:
            r.execute_command("SENTINEL", "FAILOVER", SERVICE)

    def healthy(self) -> bool:
        """Every process runs, the sentinels agree on the master, it has its replica
        linked, and every sentinel knows the other two and the replica."""
        if not all(s.is_running for s in (*self.data, *self.sentinels)):
            return False
        ports = {s.master_port() for s in self.sentinels}
        if len(ports) != 1:
            return False
        master = self.master()
        with _client(master.port) as r:
            role = r.execute_command("ROLE")
            if role[0] != "master" or len(role[2]) != 1:
                return False
        replica = self.replica()
        with _client(replica.port) as r:
            info = r.info("replication")
            if info.get("master_link_status") != "up" or info.get("master_port") != master.port:
                return False
        for sentinel in self.sentinels:
            with _client(sentinel.port) as r:
                state = r.execute_command("SENTINEL", "MASTER", SERVICE)
                # redis-py 8 parses the reply into a dict; 7 returns the flat list.
                fields = (
                    dict(state)
                    if isinstance(state, dict)
                    else dict(zip(state[::2], state[1::2], strict=True))
                )
                if str(fields.get("num-other-sentinels")) != "2":
                    return False
                if str(fields.get("num-slaves")) == "0":
                    return False
                flags = fields.get("flags", "")
                flags = ",".join(sorted(flags)) if isinstance(flags, set) else str(flags)
                if "s_down" in flags or "failover" in flags:
                    return False
                if not _replica_usable(r.execute_command("SENTINEL", "REPLICAS", SERVICE)):
                    return False
        return True

    def wait_healthy(self, timeout: float = 60) -> None:
        """Resume/restart whatever is paused or down, then wait for :meth:`healthy`."""
        for server in (*self.data, *self.sentinels):
            server.resume()
            if not server.is_running:
                server.start()
        _wait(self.healthy, timeout, "a healthy sentinel setup")

    def flushall(self) -> None:
        """Empty the master, not declared new (a deployment's store never is)."""
        self.master().forget()

    def close(self) -> None:
        for server in (*self.sentinels, *self.data):
            server.close()


__all__ = [
    "ClusterNode",
    "ClusterTopology",
    "SentinelServer",
    "SentinelTopology",
    "missing_binaries",
]


def _debug_needs_enabling(binary: str) -> bool:
    """Whether ``binary`` refuses DEBUG unless told (Redis 7+, Valkey: the option
    ``enable-debug-command``; older Redis knows no such option)."""
    found = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False)
    text = found.stdout
    if "Valkey" in text or "valkey" in binary:
        return True
    marker = text.find("v=")
    major = text[marker + 2 :].split(".", 1)[0] if marker >= 0 else ""
    return major.isdigit() and int(major) >= 7


def _replica_usable(replicas: Any) -> bool:
    """Whether a sentinel would pick the replica in a failover now: its last INFO of it
    says the link to the master is up (a sentinel refreshes that every 10 s; one that
    still remembers the link down after a repair aborts ``SENTINEL FAILOVER`` with "no
    good slave", and no new master comes)."""
    if not replicas:
        return False
    for replica in replicas:
        # redis-py 8 parses each entry into a dict; 7 returns flat lists.
        fields = (
            dict(replica)
            if isinstance(replica, dict)
            else dict(zip(replica[::2], replica[1::2], strict=True))
        )
        flags = fields.get("flags", "")
        flags = ",".join(sorted(flags)) if isinstance(flags, set) else str(flags)
        if flags != "slave" or str(fields.get("master-link-status")) != "ok":
            return False
    return True
