"""Held requests past the per-worker cap or the time horizon (where the broker's claim
cannot be renewed) go back to the broker (issue 3): unchanged, not lost, and without
the worker spinning on them."""

from __future__ import annotations

import contextlib
import secrets
import time

import kombu
from celery import Celery

from tests.limits.test_rate_limits import APP, publish
from tests.support.observer import Observer
from tests.support.waiting import wait_until
from tests.support.workers import Workers


def test_hold_horizon_hands_back_with_id_headers_and_retries(
    workers: Workers, observer: Observer, rabbitmq_url: str
) -> None:
    """Held past ``baton_hold_horizon`` (1 s here) on RabbitMQ, whose deliveries have no
    timeout to renew, a message goes back to the broker unchanged: it runs later with
    its id, its headers and its retry count. (On Redis the horizon renews the message's
    claim instead: tests/transport/test_held_renewal.py.)"""
    from tests.apps import limits

    queue = f"hold-{secrets.token_hex(4)}"
    env = {"TEST_BROKER_URL": rabbitmq_url, "LIMITS_QUEUE": queue, "LIMITS_HOLD_HORIZON": "1"}
    publisher = Celery("publisher", broker=rabbitmq_url, set_as_current=False)
    try:
        worker = workers.start(APP, concurrency=2, env=env)
        sent = [
            publisher.send_task(
                limits.paced.name, queue=queue, headers={"x_marker": marker}, retries=3
            )
            for marker in ("one", "two")
        ]
        runs = observer.wait_for(2, timeout=30)  # 12/m: the second starts 5 s after the first

        assert {r.task_id for r in runs} == {s.id for s in sent}
        assert {r.key for r in runs} == {"paced:3:one", "paced:3:two"}
        assert len(observer.started()) == 2
        log = worker.log_text()
        assert "handed back to the broker" in log
        assert "the horizon" in log
    finally:
        workers.stop_all(timeout=10)
        with contextlib.suppress(Exception), kombu.Connection(rabbitmq_url) as conn:
            conn.default_channel.queue_delete(queue)
        publisher.close()


def test_hold_max_stops_raising_prefetch_beyond_the_cap(
    workers: Workers, observer: Observer
) -> None:
    """Past ``baton_hold_max`` held requests keep their prefetch slots, so the broker
    stops sending to this worker: memory stays bounded, nothing is lost, and the worker
    does not spin fetching and handing messages back."""
    from tests.apps import limits

    worker = workers.start(APP, concurrency=2, env={"LIMITS_HOLD_MAX": "2"})
    # Celery's default prefetch (4 x 2 processes) and the 2 held past it: the worker
    # takes at most 10 of them; the rest must stay in the broker's queue.
    calls = 14
    publish(limits.crawl, calls)  # 1/m: one runs, the rest wait

    time.sleep(3)  # not a wait: the warnings are counted over these 3 s (at most 2)
    log = worker.log_text()
    warnings = log.count("past baton_hold_max")
    assert warnings >= 1, "the cap was never reached or not reported"
    assert warnings <= 2, f"{warnings} cap warnings in 3 s: not rate-limited"
    assert "handed back to the broker" not in log, "held requests spin through the broker"
    # 1/m: one starts (on a loaded machine, or within a new store's grace, maybe after
    # the 3 s above), and no other within the minute.
    wait_until(lambda: observer.started(), 20, "the first crawl's start")
    assert len(observer.started()) == 1
    # None lost: every message is held, queued, or unacked in the broker.
    with limits.app.connection_for_write() as conn:
        client = conn.default_channel.client
        queued = client.llen("celery")
        unacked = client.hlen("unacked")
    assert queued + unacked >= calls - 1
    assert queued >= 1, "the worker kept taking messages past its cap"
