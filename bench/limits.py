"""Single-client rate-limit decisions per second, beside the anchors.

    python bench/limits.py [--quick]

Every candidate decides one request against a limit high enough that it is always
granted (the common, hot path), one client, on a private redis-server. PING/s of the
same client in the same run is the baseline: a decision needs at least one round trip.

celery-baton is measured three times: one rate condition (``RateLimit.try_acquire``),
a rate + a concurrency lease + an exclusive lease decided together in one script call
(the same owner asks again each time, so its leases are re-granted, not refused), and
a weighted multi-limit decision: a task's own rate and two named limits of
``baton_limits`` with a cost of 7 and their penalty checks, in one script call.
dramatiq's limiters are used through their ``acquire()`` context manager, which
releases on exit (only the concurrent limiter has anything to release).
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable

from celery_baton.core.conditions import Rate, TakeLease
from celery_baton.core.gate import Gate
from celery_baton.core.keys import KeyNames
from celery_baton.core.rates import RateLimit, interval_us
from celery_baton.core.shared_limits import SharedLimit
from celery_baton.store import connect
from common import (
    SingleClientRun,
    compare,
    import_package,
    paired_ratio,
    parse_args,
    ratio_table,
    verdict,
)

TARGET = 0.9
HIGH = 1_000_000  # per second: never the binding constraint in these runs


def version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def candidates(url: str) -> tuple[list[tuple[str, Callable[[], object]]], list[str]]:
    store = connect(url)
    gate = Gate(store)
    one_rate = RateLimit(gate, "baton:{bench}:rate:one", rate=f"{HIGH}/s", burst=1)

    def baton_rate() -> None:
        if not one_rate.try_acquire().granted:
            raise RuntimeError("celery-baton rate decision refused")

    three = [
        Rate("baton:{bench}:rate:three", interval_us(HIGH), 1),
        TakeLease("baton:{bench}:conc:three", limit=5),
        TakeLease("baton:{bench}:ex:three", limit=1, fence=True),
    ]

    def baton_three() -> None:
        if not gate.decide(three, owner="bench-task|bench-worker|1", ttl=30).granted:
            raise RuntimeError("celery-baton combined decision refused")

    # Issue 15 §3: a task's own rate and two named limits shared with other tasks, each
    # weighted by the call's cost (7 units), with their penalty checks: five conditions
    # of three hash tags, one script call (one server; on Cluster see Gate.decide).
    names = KeyNames("baton")
    shared = [SharedLimit("openai", HIGH, HIGH), SharedLimit("db", HIGH, HIGH)]
    weighted = [
        Rate("baton:{bench}:rate:weighted", interval_us(HIGH), 1),
        *(c for limit in shared for c in limit.conditions(names, 7)),
    ]

    def baton_weighted() -> None:
        if not gate.decide(weighted, owner="-").granted:
            raise RuntimeError("celery-baton weighted multi-limit decision refused")

    # The floor of any script-based decision: one EVALSHA of a no-op script with the
    # same key and arguments as the rate decision (a yardstick, not a limiter).
    noop_sha = store.client.script_load("return {1, 0}")

    def script_floor() -> None:
        store.client.evalsha(noop_sha, 1, "baton:{bench}:rate:one", "-", 30000, "R", "1", "1")

    rows: list[tuple[str, Callable[[], object]]] = [
        ("PING", store.client.ping),
        ("(yardstick) EVALSHA of a no-op script, same args", script_floor),
        ("celery-baton rate (RateLimit.try_acquire)", baton_rate),
        ("celery-baton rate + concurrency + exclusive", baton_three),
        ("celery-baton rate + 2 named limits, cost 7 (weighted)", baton_weighted),
    ]
    missing: list[str] = []

    try:
        limits = import_package("limits")  # this script's name shadows the package
        storage = import_package("limits.storage").storage_from_string(url)
        strategies = import_package("limits.strategies")
        item = limits.RateLimitItemPerSecond(HIGH)
        moving = strategies.MovingWindowRateLimiter(storage)
        sliding = strategies.SlidingWindowCounterRateLimiter(storage)

        def limits_moving() -> None:
            if not moving.hit(item, "bench-moving"):
                raise RuntimeError("limits moving window refused")

        def limits_sliding() -> None:
            if not sliding.hit(item, "bench-sliding"):
                raise RuntimeError("limits sliding window refused")

        v = version("limits")
        rows += [
            (f"limits moving window hit() ({v})", limits_moving),
            (f"limits sliding window counter hit() ({v})", limits_sliding),
        ]
    except Exception as exc:  # an anchor that does not import is reported, not fatal
        missing.append(f"limits: {exc!r}")

    try:
        from dramatiq.rate_limits import (
            BucketRateLimiter,
            ConcurrentRateLimiter,
            WindowRateLimiter,
        )
        from dramatiq.rate_limits.backends import RedisBackend

        backend = RedisBackend(url=url)
        limiters = {
            "Bucket": BucketRateLimiter(backend, "bench-bucket", limit=HIGH, bucket=1000),
            "Window": WindowRateLimiter(backend, "bench-window", limit=HIGH, window=1),
            "Concurrent": ConcurrentRateLimiter(backend, "bench-concurrent", limit=5),
        }
        v = version("dramatiq")

        def dramatiq_call(limiter: object, name: str) -> Callable[[], None]:
            def call() -> None:
                with limiter.acquire(raise_on_failure=False) as acquired:  # type: ignore[attr-defined]
                    if not acquired:
                        raise RuntimeError(f"dramatiq {name} refused")

            return call

        for name, limiter in limiters.items():
            label = "acquire+release" if name == "Concurrent" else "acquire"
            rows.append((f"dramatiq {name}RateLimiter {label} ({v})", dramatiq_call(limiter, name)))
    except Exception as exc:
        missing.append(f"dramatiq: {exc!r}")
    return rows, missing


def server_cost(url: str, rows: list[tuple[str, Callable[[], object]]], calls: int) -> list[str]:
    """The store's own time per call of each celery-baton row: the server's count of
    microseconds spent in its commands (INFO commandstats), which the machine's noise
    hardly moves, unlike a round-trip rate."""
    client = connect(url).client
    lines = []
    for name, fn in rows:
        if not name.startswith(("PING", "celery-baton")):
            continue
        fn()
        client.config_resetstat()
        for _ in range(calls):
            fn()
        stats = client.info("commandstats")
        top = "cmdstat_ping" if name == "PING" else "cmdstat_evalsha"
        lines.append(f"| {name} | {stats[top]['usec_per_call']:.2f} |")
    return lines


def main() -> None:
    args = parse_args(__doc__ or "")
    run = SingleClientRun.start(args)
    with run.server() as server:
        rows, missing = candidates(server.url)
        samples = compare(rows, seconds=run.seconds, rounds=run.rounds)
        cost = server_cost(server.url, rows, 2_000 if args.quick else 20_000)
    print("## limits: single-client decisions per second\n")
    print(run.note())
    print(ratio_table(samples, baseline="PING", unit="decisions/s"))
    for s in samples[2:5]:
        print(f"\n{s.name} / PING: {verdict(paired_ratio(s, samples[0]), TARGET)}")
        for other in samples[5:]:
            print(f"- / {other.name}: {paired_ratio(s, other):.2f}")
    for line in missing:
        print(f"- not measured: {line}")
    print("\nStore time per call (the server's own count, after the rounds above; a script's")
    print("time includes the commands it runs):\n")
    print("| call | store µs per call |\n|---|---|")
    print("\n".join(cost))


if __name__ == "__main__":
    main()
