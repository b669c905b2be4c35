"""Held requests never take the prefetch window from the work a worker can run
(issue 35 §4), on RabbitMQ: a quorum queue (whose prefetch is per consumer, static once
the consumer exists), a classic queue (global QoS on RabbitMQ 3), and a classic queue
as RabbitMQ 4 serves it (per consumer: kombu asks no global QoS there).

One worker ``-c 2`` with prefetch multiplier 4 (a window of 8) receives 200 calls of a
task limited to 2 starts per second, then 10 plain tasks. The 200 wait in the worker
(held) for 100 s; the plain ones must start at once, not behind them. Nothing is lost:
every call has run or is back in the queue once the worker stopped, and none was
handed back to the broker while held. Judged by task id: a call that started only after
the test's own SIGTERM and came back as well is the shutdown redelivery that
test_shutdown_stale_grant.py pins, not a held request handed back.
"""

from __future__ import annotations

import time

import kombu
import pytest
from celery import Celery
from kombu import Queue

from tests.support.observer import Observer
from tests.support.workers import Workers

APP = "tests.apps.held_window"
HELD = 200
PLAIN = 10
#: The plain tasks' starts, from their publish (RabbitMQ 3 classic queue: ~0.1 s).
PLAIN_WITHIN_S = 2.0


@pytest.mark.parametrize(
    ("queue_type", "per_consumer"),
    [("quorum", False), ("classic", False), ("classic", True)],
    ids=["quorum", "classic", "classic-rabbitmq4"],
)
def test_plain_tasks_start_while_200_requests_are_held(
    workers: Workers,
    observer: Observer,
    rabbitmq_url: str,
    queue: str,
    queue_type: str,
    per_consumer: bool,
) -> None:
    from tests.apps import held_window

    env = {
        "TEST_BROKER_URL": rabbitmq_url,
        "HELD_QUEUE": queue,
        "HELD_QUEUE_TYPE": queue_type,
        "HELD_PER_CONSUMER": "1" if per_consumer else "0",
    }
    publisher = Celery("publisher", broker=rabbitmq_url, set_as_current=False)
    arguments = held_window.queue_arguments(queue_type, single_active=False)
    publisher.conf.task_queues = [Queue(queue, queue_arguments=arguments)]
    try:
        worker = workers.start(APP, concurrency=2, env=env)
        with publisher.producer_or_acquire() as producer:
            sent = {
                publisher.send_task(
                    held_window.paced.name, args=(n,), queue=queue, producer=producer
                ).id
                for n in range(HELD)
            }
        observer.starts_of("paced", 2, timeout=30)  # the backlog reached the worker
        time.sleep(1.0)  # and the worker holds what its window took of it
        published = _server_us(observer)
        with publisher.producer_or_acquire() as producer:
            for n in range(PLAIN):
                publisher.send_task(
                    held_window.quick.name, args=(n,), queue=queue, producer=producer
                )
        starts = _wait_for_starts(observer, "quick", PLAIN, timeout=30)
        latest = max(starts) - published
        assert latest < PLAIN_WITHIN_S * 1e6, (
            f"the last plain task started {latest / 1e6:.2f} s after its publish"
        )

        # Nothing lost: stopped, the worker gives its held messages back to the queue.
        stopped_at = _server_us(observer)
        worker.stop(timeout=30)
        paced = [e for e in observer.started() if e["key"] == "paced"]
        ran = {e["task_id"] for e in paced}
        assert len(ran) == len(paced), "a paced call ran twice"
        queued = queued_ids(rabbitmq_url, queue)
        assert ran | queued == sent, f"lost: {len(sent - ran - queued)} of {HELD}"
        # Nothing ran and came back, but a run that started after the test's SIGTERM
        # (test_shutdown_stale_grant.py: its ack cannot reach the broker any more).
        twice = [e for e in paced if e["task_id"] in queued]
        assert all(e["start"] > stopped_at for e in twice), (twice, stopped_at)
        # None held past the horizon (a request's own line; a store's grace at the
        # start may end in one line handing back the backlog past the window).
        assert "] handed back to the broker" not in worker.log_text()
    finally:
        workers.stop_all(timeout=10)
        publisher.close()


def _server_us(observer: Observer) -> int:
    seconds, micros = observer._redis.time()
    return int(seconds) * 1_000_000 + int(micros)


def _wait_for_starts(observer: Observer, key: str, n: int, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        starts = [e["start"] for e in observer.started() if e["key"] == key]
        if len(starts) >= n:
            return starts
        if time.monotonic() > deadline:
            raise AssertionError(f"{len(starts)} of {n} {key} tasks started in {timeout} s")
        time.sleep(0.05)


def queued_ids(url: str, queue: str) -> set[str]:
    """The task ids of the messages in ``queue`` (each got and left unacknowledged: the
    broker requeues them when this connection closes)."""
    ids: list[str] = []
    with kombu.Connection(url) as conn:
        channel = conn.channel()
        while (message := channel.basic_get(queue, no_ack=False)) is not None:
            ids.append(message.headers["id"])
    assert len(ids) == len(set(ids)), "a message is in the queue twice"
    return set(ids)


def test_a_queue_with_a_single_active_consumer_is_warned_about(
    workers: Workers, rabbitmq_url: str, queue: str
) -> None:
    """Its consumer is never opened again (a new one would hand the active role to
    another worker): the worker says at start, once, that held requests fill its window
    there."""
    env = {
        "TEST_BROKER_URL": rabbitmq_url,
        "HELD_QUEUE": queue,
        "HELD_QUEUE_TYPE": "quorum",
        "HELD_SINGLE_ACTIVE": "1",
    }
    worker = workers.start(APP, concurrency=2, env=env)
    log = worker.log_text()
    assert log.count(f"and {queue} has a single active consumer") == 1, log
    assert "opened again when held requests" not in log
