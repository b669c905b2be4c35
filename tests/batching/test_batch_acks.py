"""A batch's held messages are acked together: one broker round trip per batch, not one
per call (kombu's Redis transport acks one delivery tag per ``MULTI ZREM HDEL EXEC``;
100 of them back to back held the consumer's loop while the pool waited:
docs/benchmarks.md#batching, bound 2).

Counted from outside: the broker's transactions that remove delivery tags from kombu's
unacked index (``MONITOR``, grouped per client connection), and at the end no message of
the calls left unacked (none would come back after the visibility timeout).
"""

from __future__ import annotations

import contextlib
import secrets
from typing import Any

from tests.batching.test_batching import assert_each_call_once, settle
from tests.support.monitor import monitored, transactions
from tests.support.observer import Observer, Run
from tests.support.servers import StoreServer
from tests.support.waiting import broadcast, wait_until
from tests.support.workers import Workers

APP = "tests.apps.batching"
CALLS = 100  # two batches of 50 (``wide``)


def drain_watched(
    workers: Workers, observer: Observer, broker_server: StoreServer, account: str, calls: int
) -> tuple[list[Run], list[dict[str, Any]]]:
    """``calls`` calls of ``wide`` queued, then drained by one worker while ``MONITOR``
    watches the broker: the runs (every call once, each caller its own result, no
    message left unacked or queued) and the broker's commands meanwhile."""
    from tests.apps.batching import wide

    workers.start(APP, concurrency=2, queues="not-yet")
    results = [wide.apply_async(kwargs={"account": account, "doc": n}) for n in range(calls)]
    with monitored(broker_server) as commands:
        replies = broadcast(
            wide.app,
            lambda: wide.app.control.add_consumer("celery", reply=True, timeout=10, limit=1),
        )
        assert len(replies) == 1, f"the worker does not consume the task queue: {replies}"
        runs = settle(observer, "wide", calls)
        assert [r.get(timeout=30) for r in results] == [n * 2 for n in range(calls)]
        with broker_server.client() as client:
            wait_until(
                lambda: client.hlen("unacked") == 0 and client.llen("celery") == 0,
                timeout=10,
                what="no message left unacked or queued",
            )
    assert_each_call_once(runs, [r.id for r in results])
    return runs, commands


def test_a_batch_s_messages_are_acked_in_one_round_trip(
    workers: Workers, observer: Observer, broker_server: StoreServer
) -> None:
    runs, commands = drain_watched(workers, observer, broker_server, "acks", CALLS)
    # The tags each transaction (or lone command) took out of kombu's unacked index.
    # (``ZREM unacked_index <tag> ...``: one command may name several tags.)
    sizes = [
        sum(len(c.split()) - 2 for c in removed)
        for block in transactions(commands)
        if (removed := [c for c in block if c.upper().startswith("ZREM") and "unacked_index" in c])
    ]
    acked = sum(sizes)
    print(f"{len(runs)} runs; ack transactions: {len(sizes)}, tags per transaction {sizes}")
    assert acked >= CALLS, f"only {acked} of {CALLS} deliveries seen acked"
    # One per batch, plus a few for calls acked on their own (a carrier's own ack is
    # Celery's, after its run): far from one per call.
    assert len(sizes) <= 2 * len(runs) + 4, (
        f"{len(sizes)} ack round trips for {CALLS} calls in {len(runs)} runs"
    )


def test_on_rabbitmq_a_batch_s_messages_are_acked_one_by_one_and_none_is_left(
    workers: Workers, observer: Observer, rabbitmq_url: str
) -> None:
    """The acks-together path is kombu's Redis transport's; on RabbitMQ (AMQP acks are
    frames sent without waiting) each held call is acked as Celery acks it. Judged from
    outside: every call once in a successful run of its key, and once the workers
    stopped (a message still unacked would be requeued then) the queue is empty."""
    import kombu
    from celery import Celery

    from tests.apps.batching import wide

    queue = f"batch-acks-{secrets.token_hex(4)}"
    env = {"TEST_BROKER_URL": rabbitmq_url, "BATCH_QUEUE": queue}
    publisher = Celery("publisher", broker=rabbitmq_url, set_as_current=False)
    try:
        workers.start(APP, concurrency=2, env=env, wait=False)
        workers.start(APP, concurrency=2, env=env, wait=False)
        for worker in workers.started:
            worker.wait_ready()
        ids = [
            publisher.send_task(
                wide.name, kwargs={"account": f"r{n % 2}", "doc": n}, queue=queue
            ).id
            for n in range(CALLS)
        ]
        runs = settle(observer, "wide", CALLS)
        assert_each_call_once(runs, ids)
        assert all(len(set(r.key.split(":", 1)[1].split("|"))) == 1 for r in runs)
        workers.stop_all(timeout=20)
        with kombu.Connection(rabbitmq_url) as conn:
            left = conn.default_channel.queue_declare(queue, passive=True).message_count
        assert left == 0, f"{left} messages of the calls left in the queue (not acked)"
    finally:
        workers.stop_all(timeout=10)
        with contextlib.suppress(Exception), kombu.Connection(rabbitmq_url) as conn:
            conn.default_channel.queue_delete(queue)
        publisher.close()


def test_on_a_quorum_queue_a_burst_makes_full_batches(
    workers: Workers, observer: Observer, rabbitmq_url: str
) -> None:
    """On a quorum queue RabbitMQ applies the prefetch per consumer and fixes it when the
    consumer is made: held calls raise Celery's count, which does not reach it. Batched
    calls are held like the requests a limit holds, so the consumer is opened again for
    them (worker/transport/consumer_window.py), and a burst still makes full batches,
    not batches of the window's size (8 here: -c 2 at Celery's multiplier of 4)."""
    import kombu
    from celery import Celery
    from kombu import Queue

    from tests.apps.batching import fill
    from tests.batching.test_batching import call_ids

    queue = f"batch-quorum-{secrets.token_hex(4)}"
    arguments = {"x-queue-type": "quorum"}
    env = {"TEST_BROKER_URL": rabbitmq_url, "BATCH_QUEUE": queue, "BATCH_QUEUE_TYPE": "quorum"}
    publisher = Celery("publisher", broker=rabbitmq_url, set_as_current=False)
    publisher.conf.task_queues = [Queue(queue, queue_arguments=arguments)]
    try:
        workers.start(APP, concurrency=2, env=env)
        with publisher.producer_or_acquire() as producer:
            ids = [
                publisher.send_task(
                    fill.name, kwargs={"account": "q", "doc": n}, queue=queue, producer=producer
                ).id
                for n in range(30)
            ]
        runs = settle(observer, "fill", 30)
        assert_each_call_once(runs, ids)
        sizes = sorted(len(call_ids(r)) for r in runs)
        assert sizes.count(10) >= 2, f"batch sizes {sizes}"
    finally:
        workers.stop_all(timeout=10)
        with contextlib.suppress(Exception), kombu.Connection(rabbitmq_url) as conn:
            conn.default_channel.queue_delete(queue)
        publisher.close()
