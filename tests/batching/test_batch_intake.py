"""A batching worker takes its calls' messages in several at a time from a Redis broker
(kombu takes one per ``BRPOP`` and records each unacked in a ``MULTI ZADD HSET EXEC`` of
its own: two round trips per call on the consumer's one thread, which bounded a batched
drain: docs/benchmarks.md#batching, bound 1).

Counted from outside with ``MONITOR`` on the broker: the round trips that take a message
in (``BRPOP`` answers, kombu's own unacked records, the intake script's calls) against
the calls; then every call in exactly one successful run, each caller's own result, and
no message left unacked or in the queue. (A worker SIGKILLed while it holds calls taken
in so, and a broker restart: tests/batching/test_batching_faults.py, whose workers take
their messages in this way.)
"""

from __future__ import annotations

from tests.batching.test_batch_acks import drain_watched
from tests.support.monitor import transactions
from tests.support.observer import Observer
from tests.support.servers import StoreServer
from tests.support.workers import Workers

CALLS = 200  # four batches of 50 (``wide``)


def _intake_round_trips(commands: list[dict[str, object]]) -> dict[str, int]:
    """The broker round trips a consumer spent taking messages in, by kind."""
    counts = {"brpop": 0, "kombu_records": 0, "intake_scripts": 0}
    # A script's own commands are listed too, from the client "lua": not round trips.
    sent = [c for c in commands if c.get("client_address") != "lua"]
    for block in transactions(sent):
        first = block[0].upper() if block else ""
        if first.startswith("BRPOP"):
            counts["brpop"] += 1
        elif first.startswith("ZADD") and "unacked_index" in block[0]:
            counts["kombu_records"] += 1
        elif first.startswith(("EVALSHA", "EVAL ")) and "unacked_index" in block[0]:
            counts["intake_scripts"] += 1
    return counts


def test_a_batching_worker_takes_its_messages_in_several_per_round_trip(
    workers: Workers, observer: Observer, broker_server: StoreServer
) -> None:
    runs, commands = drain_watched(workers, observer, broker_server, "intake", CALLS)
    counts = _intake_round_trips(commands)
    spent = sum(counts.values())
    print(f"{len(runs)} runs; intake round trips for {CALLS} calls: {counts}")
    # kombu's intake: two per call (400). Taken in several at a time: the window's room
    # per BRPOP answer, the script's call and the BRPOP's own (a few dozen).
    assert spent <= CALLS * 3 // 4, f"{spent} intake round trips for {CALLS} calls: {counts}"
