"""Which master serves a Redis Cluster slot, and which history that master has.

A Cluster shard's master may be replaced by a replica that was behind (its master
SIGKILLed), or restart without its data at the same address: the writes it
acknowledged last are gone. Nothing tells a client so (redis-py follows the new master
only once a call fails or is MOVED), so whoever must write something again on such a
master asks, now and then, who serves the slots it wrote to (core/recorded_ends.py).

A master is named by its address and its replication id (``master_replid``): a promoted
replica has another address; a master restarted empty has the same address and a new
replication id. Two cheap calls: ``CLUSTER SLOTS`` to any node, and ``INFO
replication`` to each master asked about.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from redis.crc import key_slot

#: A master's replication id when it could not be read (it did not answer): compared
#: by address alone then.
UNKNOWN = ""


@dataclass(frozen=True)
class ShardMaster:
    """The master serving a slot: its ``host:port`` and replication id (or UNKNOWN)."""

    address: str
    replid: str = UNKNOWN

    def replaced_by(self, other: ShardMaster) -> bool:
        """Whether ``other`` is another master (or this one with another history): a
        master that did not say its replication id is judged by its address."""
        if self.address != other.address:
            return True
        return UNKNOWN not in (self.replid, other.replid) and self.replid != other.replid


class ShardMasters:
    """Asks a cluster client who serves which slot (``masters``): called off the event
    loops, on a thread of its own (each call waits for the store)."""

    def __init__(self, client: Any) -> None:
        self._client = client  # a redis.cluster.RedisCluster

    @staticmethod
    def slot(key: str) -> int:
        """The Cluster slot of ``key`` (its hash tag's, if it has one)."""
        return int(key_slot(key.encode()))

    def masters(self, slots: Collection[int]) -> dict[int, ShardMaster]:
        """The master serving each of ``slots`` now, as the cluster says (a slot no
        master serves is left out). Raises what the client raises when no node answers."""
        client = self._client
        layout: dict[tuple[int, int], dict[str, Any]] = client.cluster_slots()
        found: dict[int, ShardMaster] = {}
        replids: dict[tuple[str, int], str] = {}
        for (start, end), served in layout.items():
            host, port = served["primary"][0], int(served["primary"][1])
            for slot in slots:
                if not start <= slot <= end:
                    continue
                if (host, port) not in replids:
                    replids[(host, port)] = self._replid(host, port)
                found[slot] = ShardMaster(f"{host}:{port}", replids[(host, port)])
        return found

    def _replid(self, host: str, port: int) -> str:
        node = self._client.get_node(host=host, port=port)
        if node is None:  # a node the client has not met yet: by its address alone
            return UNKNOWN
        try:
            info = self._client.info("replication", target_nodes=node)
        except Exception:  # down, or refuses INFO (a renamed command): by its address
            return UNKNOWN
        return str(info.get("master_replid", UNKNOWN)) if isinstance(info, dict) else UNKNOWN


__all__ = ["ShardMaster", "ShardMasters"]
