"""A real Redis Cluster for tests: :class:`ClusterTopology` (``masters`` masters with
one replica each) of :class:`ClusterNode` servers. See :mod:`tests.support.topologies`.
"""

from __future__ import annotations

import contextlib
import subprocess
import time

import redis
import redis.cluster

from tests.support import processes
from tests.support.servers import StoreServer, free_port
from tests.support.topologies import _client, _wait

#: Cluster nodes declare a peer failed after this long without an answer (ms). Small,
#: so that a killed master's replica is promoted within a few seconds.
CLUSTER_NODE_TIMEOUT_MS = 1000
#: A cluster master that started less than this long ago (s) gives a task family
#: without an epoch a grace (gate.lua, "E"): it ends a lease_ttl after the master's
#: start, read from its uptime in whole seconds (up to 1 s late). The longest lease_ttl
#: the tests use on the cluster (9 s; the default is 8 s), that second and a margin.
YOUNG_S = 12


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

    def start(self) -> None:
        """Start as :meth:`StoreServer.start` does; a restart that finds the bus port taken
        (a port chosen free at the session's start can be taken by any process later: seen
        in a CI rehearsal beside a soak) takes another one. The other nodes learn it from
        the node's first ping (the bus port travels in every cluster message's header)."""
        for attempt in range(3):
            try:
                super().start()
                return
            except RuntimeError:
                if attempt == 2 or not self._bus_port_was_taken():
                    raise
                self.bus_port = free_port()

    def _bus_port_was_taken(self) -> bool:
        return any(
            "Address already in use" in line and str(self.bus_port) in line
            for line in processes.log_tail(self.log_path, lines=10).splitlines()
        )

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


__all__ = [
    "ClusterNode",
    "ClusterTopology",
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
