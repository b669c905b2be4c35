"""The gate script of two or more revisions side by side, on one server, in one run.

    python bench/gate_cost.py [--revs 98d55cd,main,.] [--decision three|rate] [--quick]

Each revision's ``gate.lua`` (``git show REV:src/...``, joined with its fragments in
``lua/gate/`` where it has them; ``.`` is this checkout's, and a name ending in ``.lua``
a file on disk: a change tried before it is committed) is
loaded into one private redis-server and called with the arguments a worker sends
on one server: the conditions of a rate + a concurrency cap + an exclusive lease, and,
for a script that knows them, the store-wide epoch (the worker's ``grace_key``) and the
family epoch, in that revision's layout (``--decision rate``: one rate condition
alone, no lease and so no epoch: the script's fixed cost per call). Two decisions:

* **same owner**: the same owner asks again each time (as ``bench/limits.py``);
* **worker-like**: a new owner each time, released after (the release is sent as
  ``EVAL``, so the server's ``EVALSHA`` count is the gate's alone).

Rounds are interleaved and their order rotates, so the machine's slow spells fall on
every revision alike. Reported per revision: the store's own microseconds per gate call
(``INFO commandstats``, which other work on the machine hardly moves) and, for the
same-owner decision, calls per second x PING (the median of per-round ratios).
"""

from __future__ import annotations

import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from celery_baton.core.conditions import Condition, Rate, TakeLease
from celery_baton.core.gate import Release, gate_call
from celery_baton.core.keys import KeyNames
from celery_baton.core.rates import interval_us
from celery_baton.store.scripts import join_gate, script_source
from common import REPO_DIR, SingleClientRun, parse_args

HIGH = 1_000_000  # per second: never the binding constraint
LUA_DIR = "src/celery_baton/store/lua"


def three(tag: str) -> list[Condition]:
    """The three conditions, on keys of their own (one family per revision and decision)."""
    return [
        Rate(f"baton:{{{tag}}}:rate:three", interval_us(HIGH), 1),
        TakeLease(f"baton:{{{tag}}}:conc:three", limit=5),
        TakeLease(f"baton:{{{tag}}}:ex:three", limit=1, fence=True),
    ]


def rate(tag: str) -> list[Condition]:
    """One rate condition: no lease, so no store epoch either."""
    return [Rate(f"baton:{{{tag}}}:rate:one", interval_us(HIGH), 1)]


DECISIONS = {"three": three, "rate": rate}


def source(rev: str) -> str:
    if rev == ".":
        return script_source("gate")
    if rev.endswith(".lua"):  # a variant on disk, to try a change before committing it
        return Path(rev).read_text()

    def read(path: str) -> str:
        return subprocess.run(
            ["git", "-C", str(REPO_DIR), "show", f"{rev}:{LUA_DIR}/{path}"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout

    frame = read("gate.lua")
    return join_gate(read) if "-- @check" in frame else frame  # fragments: joined


def call_args(text: str, conditions: list[Condition], owner: str) -> tuple[list[str], list[object]]:
    """What a worker on one server sends this revision's script (its layout read from its
    text): the store epochs as keys past the conditions' (now), as conditions "G" and
    "E" (the layout before), or not at all (before the store epochs)."""
    keys, args = gate_call(conditions, owner, 30.0, grace_key=KeyNames().store_epoch)
    if "KEYS[n + 1]" in text:
        return keys, args
    n = len(conditions)
    if "kind == 'E'" in text:
        family, grace = keys[n:]
        return [*keys[:n], grace, family], [*args, "G", "", "", "E", "", ""]
    return keys[:n], args


def main() -> None:
    args = parse_args(
        __doc__ or "",
        revs={"default": "98d55cd,main,."},
        decision={"default": "three", "choices": sorted(DECISIONS)},
    )
    conditions_of = DECISIONS[args.decision]
    run = SingleClientRun.start(args)
    revs = args.revs.split(",")
    calls = 500 if args.quick else 2_000
    with run.server() as server:
        r = server.client()
        r.set(KeyNames().store_epoch, 0)  # a store known to be new: no grace
        release_src = script_source("release")
        shas = {rev: r.script_load(source(rev)) for rev in revs}
        texts = {rev: source(rev) for rev in revs}
        nonce = iter(range(10**9))

        def same_owner(rev: str) -> Callable[[], object]:
            keys, argv = call_args(texts[rev], conditions_of(f"same-{rev}"), "bench|same|1")
            return lambda: r.evalsha(shas[rev], len(keys), *keys, *argv)

        def worker_like(rev: str) -> Callable[[], object]:
            conditions = conditions_of(f"worker-{rev}")
            lease_keys = tuple(c.key for c in conditions if isinstance(c, TakeLease))

            def call() -> object:
                owner = f"bench-{next(nonce)}|w|1"
                keys, argv = call_args(texts[rev], conditions, owner)
                reply = r.evalsha(shas[rev], len(keys), *keys, *argv)
                if reply[0] != 1:
                    raise RuntimeError(f"{rev}: denied {reply}")
                if not lease_keys:
                    return reply
                rk, ra = Release(lease_keys, owner).script_call("baton:released")
                r.eval(release_src, len(rk), *rk, *ra)
                return reply

            return call

        def cpu() -> float:
            info = r.info("cpu")
            return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])

        def measure(fn: Callable[[], object], command: str) -> tuple[float, float, float]:
            """(calls per second, store µs per call in the command, store CPU µs per
            call in all) over ``calls`` calls."""
            r.config_resetstat()
            cpu_before = cpu()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            elapsed = time.perf_counter() - start
            cpu_us = (cpu() - cpu_before) * 1e6 / calls
            usec = float(r.info("commandstats")[f"cmdstat_{command}"]["usec_per_call"])
            return calls / elapsed, usec, cpu_us

        for rev in revs:  # warm up, and make every key busy
            for _ in range(50):
                same_owner(rev)()
                worker_like(rev)()
        rates: dict[str, list[float]] = {rev: [] for rev in ["PING", *revs]}
        usec: dict[tuple[str, str], list[float]] = {}
        for round_no in range(run.rounds):
            order = revs[round_no % len(revs) :] + revs[: round_no % len(revs)]
            if round_no % 2:
                order.reverse()
            rates["PING"].append(measure(r.ping, "ping")[0])
            for rev in order:
                rate, us, cpu_us = measure(same_owner(rev), "evalsha")
                rates[rev].append(rate)
                usec.setdefault(("same owner", rev), []).append(us)
                usec.setdefault(("same owner cpu", rev), []).append(cpu_us)
                _, us, cpu_us = measure(worker_like(rev), "evalsha")
                usec.setdefault(("worker-like", rev), []).append(us)
                usec.setdefault(("worker-like cpu", rev), []).append(cpu_us)
    print(f"## gate.lua side by side: {args.decision}\n")
    print(run.note())
    print(
        f"{calls} calls per measurement. Store µs per gate call: in the script (commandstats)"
        " and the server's CPU in all (INFO cpu: the call, its reading and its reply);"
        " median over rounds (range).\n"
    )
    kinds = ("same owner", "same owner cpu", "worker-like", "worker-like cpu")
    print(
        "| revision | x PING, same owner | script µs, same owner | CPU µs, same owner "
        "| script µs, worker-like | CPU µs, worker-like |"
    )
    print("|---|---|---|---|---|---|")
    for rev in revs:
        ratio = statistics.median(v / p for v, p in zip(rates[rev], rates["PING"], strict=True))
        cells = []
        for kind in kinds:
            values = usec[(kind, rev)]
            cells.append(f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})")
        print(f"| {rev} | {ratio:.2f} | {' | '.join(cells)} |")
    base = revs[0]
    for kind in kinds:
        for rev in revs[1:]:
            paired = [a / b for a, b in zip(usec[(kind, rev)], usec[(kind, base)], strict=True)]
            print(f"- {kind}: {rev} / {base}: {statistics.median(paired):.3f} (paired rounds)")


if __name__ == "__main__":
    main()
