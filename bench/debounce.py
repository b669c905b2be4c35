"""Single-client debounce calls per second, beside a hand-written Redis debounce.

    python bench/debounce.py [--quick]

The anchor is the debounce people write by hand on Redis: at publish ``SET
debounce:<key> <task id> PX <ttl>`` (the latest wins) and a countdown on the message;
at the worker ``GET`` the key and run only if it still names this task id. It has no
max_wait, no resolution of superseded results, and loses the run when the publisher
dies between its SET and the broker send (the key names a message never sent).

celery-baton's publish is one ``debounce_record`` script call (after the broker send),
its worker side one ``debounce_decide`` call per delivery. Each message of a burst
costs one publish call and one decision; a burst of 10 per key is measured (9
superseded, then the latest's wait), plus the publish call alone. PING/s of the same
client in the same run is the baseline.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

from celery_baton.core.debounce import Debounces, FlowKind, FlowPolicy, debounce_keys
from celery_baton.core.keys import KeyNames
from celery_baton.store import connect
from common import SingleClientRun, compare, paired_ratio, parse_args, ratio_table

BURST = 10
POLICY = FlowPolicy(FlowKind.DEBOUNCE, 5.0, None, max_wait=60.0)


def candidates(url: str) -> list[tuple[str, Callable[[], object]]]:
    store = connect(url)
    client = store.client
    debounces = Debounces(store, KeyNames())
    ids = itertools.count()
    keys = itertools.count()

    def anchor_publish() -> None:
        client.set("debounce:one", f"id{next(ids)}", px=600_000)

    def anchor_burst() -> None:
        key = f"debounce:{next(keys) % 1000}"
        sent = [f"id{next(ids)}" for _ in range(BURST)]
        for task_id in sent:
            client.set(key, task_id, px=600_000)
        for task_id in sent:
            if client.get(key) == task_id.encode() and task_id != sent[-1]:
                raise RuntimeError("anchor: a superseded id was the latest")

    def baton_publish() -> None:
        debounces.record(POLICY, "baton:{bench}:db:one", f"id{next(ids)}")

    def baton_burst() -> None:
        key = f"baton:{{bench}}:db:{next(keys) % 1000}"
        sent = [f"id{next(ids)}" for _ in range(BURST)]
        for task_id in sent:
            debounces.record(POLICY, key, task_id)
        for task_id in sent:
            script, keys_, args = POLICY.decide_call(key, task_id, "")
            reply = store.scripts.call(script, keys_, args)
            if int(reply[0]) == 1:
                raise RuntimeError("baton: ran before the quiet time")

    return [
        ("PING", client.ping),
        ("hand-written SET (publish)", anchor_publish),
        ("celery-baton debounce_record (publish)", baton_publish),
        (f"hand-written burst of {BURST}: SET each, GET each", anchor_burst),
        (f"celery-baton burst of {BURST}: record each, decide each", baton_burst),
    ]


def server_cost(url: str) -> list[str]:
    client = connect(url).client
    stats = client.info("commandstats")
    rows = []
    for name in ("ping", "set", "get", "evalsha"):
        entry = stats.get(f"cmdstat_{name}")
        if entry:
            rows.append(f"| {name.upper()} | {entry['usec_per_call']:.2f} |")
    return rows


def closed_burst_memory(url: str) -> int:
    """Bytes the store keeps after a burst of BURST ran: the state hash and ``ran``."""
    store = connect(url)
    quick = FlowPolicy(FlowKind.DEBOUNCE, 0.001, None)
    key = "baton:{bench}:db:closed"
    sent = [f"closed{i}" for i in range(BURST)]
    for task_id in sent:
        Debounces(store, KeyNames()).record(quick, key, task_id)
    time.sleep(0.01)
    script, keys, args = quick.decide_call(key, sent[-1], "")
    if int(store.scripts.call(script, keys, args)[0]) != 1:
        raise RuntimeError("the closed burst did not run")
    return sum(int(store.client.memory_usage(k) or 0) for k in debounce_keys(key))


def main() -> None:
    args = parse_args(__doc__ or "")
    run = SingleClientRun.start(args)
    with run.server() as server:
        rows = candidates(server.url)
        connect(server.url).client.config_resetstat()
        samples = compare(rows, seconds=run.seconds, rounds=run.rounds)
        cost = server_cost(server.url)
        memory = closed_burst_memory(server.url)
    print("## debounce: single-client calls per second\n")
    print(run.note())
    print(ratio_table(samples, baseline="PING", unit="calls/s"))
    print(f"\npublish: celery-baton / hand-written: {paired_ratio(samples[2], samples[1]):.2f}")
    print(f"burst: celery-baton / hand-written: {paired_ratio(samples[4], samples[3]):.2f}")
    print("\nStore time per command (the server's own count over the whole run):\n")
    print("| command | store µs per call |\n|---|---|")
    print("\n".join(cost))
    print(f"\nStore memory after a burst of {BURST} ran (state + ran): {memory} bytes")


if __name__ == "__main__":
    main()
