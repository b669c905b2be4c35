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
from tests.support.monitor import intake_round_trips
from tests.support.observer import Observer
from tests.support.servers import StoreServer
from tests.support.workers import Workers

CALLS = 200  # four batches of 50 (``wide``)


def test_a_batching_worker_takes_its_messages_in_several_per_round_trip(
    workers: Workers, observer: Observer, broker_server: StoreServer
) -> None:
    runs, commands = drain_watched(workers, observer, broker_server, "intake", CALLS)
    counts = intake_round_trips(commands)
    spent = sum(counts.values())
    print(f"{len(runs)} runs; intake round trips for {CALLS} calls: {counts}")
    # kombu's intake: two per call (400). Taken in several at a time: the window's room
    # per BRPOP answer, the script's call and the BRPOP's own (a few dozen).
    assert spent <= CALLS * 3 // 4, f"{spent} intake round trips for {CALLS} calls: {counts}"
