"""Single-client lock acquire+release pairs per second, beside the anchors.

    python bench/locks.py [--quick]

Every candidate takes a free lock and releases it (two round trips), one client, one
connection, on a private redis-server. PING/s of the same client in the same run is
the baseline: a pair costs at least two PINGs, so 0.5 x PING/s is the ceiling.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable

import redis

from celery_baton.core.gate import Gate
from celery_baton.core.leases import Lease
from celery_baton.store import connect
from common import (
    SingleClientRun,
    compare,
    paired_ratio,
    parse_args,
    ratio_table,
    verdict,
)

TARGET = 0.45


def version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def candidates(url: str) -> tuple[list[tuple[str, Callable[[], object]]], list[str]]:
    store = connect(url)
    client = store.client
    lease = Lease(Gate(store), "baton:{bench}:ex:k1", ttl=30)

    def baton_pair() -> None:
        if not lease.acquire() or not lease.release():
            raise RuntimeError("celery-baton lease pair failed")

    # The floor of any script-based pair: two EVALSHAs of a no-op script with the
    # same keys and arguments as the gate and release calls (not a lock; a yardstick).
    noop_sha = client.script_load("return 1")
    key, owner = lease.key, lease.owner

    def script_floor() -> None:
        client.evalsha(noop_sha, 1, key, owner, 30000, "L", "1", "1")
        client.evalsha(noop_sha, 1, key, owner, 1, 0, "", "baton:released")

    rows: list[tuple[str, Callable[[], object]]] = [
        ("PING", client.ping),
        ("celery-baton Lease", baton_pair),
        ("(yardstick) 2 x EVALSHA of a no-op script, same args", script_floor),
    ]
    missing: list[str] = []

    rlock = client.lock("bench:redis-py-lock", timeout=30)

    def redis_py_pair() -> None:
        if not rlock.acquire(blocking=False):
            raise RuntimeError("redis-py Lock pair failed")
        rlock.release()

    rows.append((f"redis-py Lock ({version('redis')})", redis_py_pair))

    try:
        import redis_lock

        plain = redis.Redis.from_url(url)
        plock = redis_lock.Lock(plain, "bench:python-redis-lock", expire=30)

        def python_redis_lock_pair() -> None:
            if not plock.acquire(blocking=False):
                raise RuntimeError("python-redis-lock pair failed")
            plock.release()

        rows.append((f"python-redis-lock ({version('python-redis-lock')})", python_redis_lock_pair))
    except Exception as exc:  # an anchor that does not import is reported, not fatal
        missing.append(f"python-redis-lock: {exc!r}")

    try:
        from celery_once.backends.redis import Redis as OnceRedis

        once = OnceRedis({"url": url, "blocking": False})

        def celery_once_pair() -> None:
            once.raise_or_lock("qo_bench_once", timeout=30)  # raises AlreadyQueued if held
            once.clear_lock("qo_bench_once")

        rows.append((f"celery-once redis backend ({version('celery-once')})", celery_once_pair))
    except Exception as exc:
        missing.append(f"celery-once: {exc!r}")

    try:
        from celery_singleton.backends.redis import RedisBackend as SingletonRedis

        singleton = SingletonRedis(url)

        def celery_singleton_pair() -> None:
            if not singleton.lock("SINGLETONLOCK_bench", "task-id", expiry=30):
                raise RuntimeError("celery-singleton pair failed")
            singleton.unlock("SINGLETONLOCK_bench")

        rows.append(
            (
                f"celery-singleton redis backend ({version('celery-singleton')})",
                celery_singleton_pair,
            )
        )
    except Exception as exc:
        missing.append(f"celery-singleton: {exc!r}")
    return rows, missing


def main() -> None:
    args = parse_args(__doc__ or "")
    run = SingleClientRun.start(args)
    with run.server() as server:
        rows, missing = candidates(server.url)
        samples = compare(rows, seconds=run.seconds, rounds=run.rounds)
    print("## locks: single-client acquire+release pairs per second\n")
    print(run.note())
    print(ratio_table(samples, baseline="PING", unit="pairs/s"))
    baton = next(s for s in samples if s.name == "celery-baton Lease")
    print(f"\ncelery-baton Lease / PING: {verdict(paired_ratio(baton, samples[0]), TARGET)}")
    for s in samples[2:]:
        print(f"- celery-baton Lease / {s.name}: {paired_ratio(baton, s):.2f}")
    for line in missing:
        print(f"- not measured: {line}")


if __name__ == "__main__":
    main()
