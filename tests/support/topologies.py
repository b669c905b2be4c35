"""Production store topologies for tests: what the Redis Cluster
(:mod:`tests.support.cluster_topology`) and the Sentinel setup
(:mod:`tests.support.sentinel_topology`) share.

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

import shutil
import time
from collections.abc import Callable

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry


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


__all__ = ["missing_binaries"]
