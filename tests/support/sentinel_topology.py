"""A real Sentinel setup for tests: :class:`SentinelTopology` (1 master, 1 replica and
3 :class:`SentinelServer` sentinels). See :mod:`tests.support.topologies`.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from typing import Any

import redis

from tests.support.servers import StoreServer
from tests.support.topologies import _client, _wait

#: Sentinels declare a master down after this long without an answer (ms).
SENTINEL_DOWN_AFTER_MS = 1000
SERVICE = "baton"


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

    def failover(self, attempts: int = 3, wait: float = 12.0) -> None:
        """``SENTINEL FAILOVER baton`` (a planned switch: the replica becomes master),
        sent again until the sentinels name another master. A sentinel can drop a
        failover it started (past its failover-timeout, 5 s here, on a busy machine: a
        quiet CI rehearsal saw no new master in 30 s) and refuses a new one while one is
        in progress; the switch is the test's action, not what the test judges."""
        old = self.master()
        for _ in range(attempts):
            with contextlib.suppress(redis.ResponseError), _client(self.sentinels[0].port) as r:
                r.execute_command("SENTINEL", "FAILOVER", SERVICE)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                with contextlib.suppress(LookupError, StopIteration, redis.RedisError):
                    if self.master() is not old:
                        return
                time.sleep(0.05)

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
    "SentinelServer",
    "SentinelTopology",
]


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
