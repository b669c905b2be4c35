"""What the lease tests share: the key they contend for, and who holds a key now."""

from __future__ import annotations

import redis

KEY = "baton:{t}:ex:k"


def owners(r: redis.Redis, key: str = KEY) -> dict[str, str]:
    return {f[2:]: v for f, v in r.hgetall(key).items() if f.startswith("o:")}
