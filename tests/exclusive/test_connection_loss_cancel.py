"""``worker_cancel_long_running_tasks_on_connection_loss`` (Celery 6's default): a worker
that loses its broker asks its pool to stop every running ``acks_late`` job, and each
message comes back when the broker does. The exclusive key of a stopped run is freed
only once its body has ended (a pool process that takes time to die, a greenlet that
unwinds; the threads and solo pools cannot stop a body at all: it runs to its end): a
waiting call of the key on another worker never overlaps it, and the copy that comes
back runs after both.

Judged by the observer (its own server: the broker cut here is the first worker's
alone): the runs of the key never overlap, and the waiting call runs.
"""

from __future__ import annotations

import time

import pytest

from tests.support.observer import Observer, assert_no_overlap
from tests.support.pools import ALL_POOLS
from tests.support.servers import StoreServer
from tests.support.waiting import wait_until
from tests.support.workers import Workers

APP = "tests.apps.conn_loss"
#: The pools whose jobs Celery can stop (threads and solo cannot: the body runs on).
STOPPED = {"prefork", "gevent", "eventlet"}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("pool", ALL_POOLS)
def test_a_run_stopped_by_a_lost_broker_frees_its_key_once_its_body_ended(
    pool: str, workers: Workers, observer: Observer, own_broker: StoreServer
) -> None:
    from kombu import Connection

    from tests.apps.conn_loss import ex_lingering

    key = f"lost-{pool}"
    cut_off = workers.start(
        APP, pool=pool, concurrency=2, env={"TEST_BROKER_URL": own_broker.url(0)}
    )
    workers.start(APP, concurrency=2)
    with Connection(own_broker.url(0)) as connection:
        ex_lingering.apply_async((key, 4.0, 2.0), connection=connection)
    wait_until(lambda: observer.running(key) == 1, 30, "the first run to start")
    waiting = ex_lingering.delay(key, 0.2, 0.0)  # on the shared broker: the other worker
    with own_broker.client(0) as broker:  # A's connections cut; the broker keeps its data
        broker.client_kill_filter(_type="normal", skipme=True)
    wait_until(
        lambda: "Connection to broker lost" in cut_off.log_text(), 30, "A to lose its broker"
    )
    assert waiting.get(timeout=60)
    if pool in STOPPED:
        # A reconnects at once: the stopped run's message comes back and runs again.
        runs = observer.runs_of(key, 3, timeout=90)
    else:
        # The body ran to its end; its ack, sent on the cut connection, failed: the copy
        # comes back after the visibility timeout, as with Celery alone.
        time.sleep(3.0)
        runs = observer.runs_of(key, 2, timeout=30)
    assert_no_overlap(runs)
    assert waiting.id in {run.task_id for run in runs}
