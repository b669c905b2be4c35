"""A request that waits in the worker for a pool process when the broker connection is
lost does not run there: Celery dropped it, and its message comes back from the broker.

Found by the nemesis soak (seed 682791223): an exclusive call granted without a slot of
its own (a skip duplicate's grace) waited for a process of a ``--max-tasks-per-child``
pool; the connection was lost, Celery dropped the request and celery-baton gave its key
back; when the replacement process came up, the waiting request was handed to it anyway
and ran without its lease, beside another worker's run of the key. The same wait holds
plain requests (they wait in the same line for a process that can start them), whose
message the broker meanwhile gives again: the call ran twice.
"""

from __future__ import annotations

import subprocess
import time
from collections import Counter

import pytest
from celery import Celery
from kombu import Queue

from tests.support.observer import Observer
from tests.support.waiting import wait_until
from tests.support.workers import Workers
from tests.transport.test_shutdown_stale_grant import _close_broker_connections

APP = "tests.apps.held_window"
CALLS = 4


def test_a_plain_request_waiting_for_a_process_across_a_lost_connection_runs_once(
    workers: Workers, observer: Observer, rabbitmq_url: str, queue: str
) -> None:
    """``-c 1 --max-tasks-per-child=1``, each leaving process taking 4 s to exit: after
    the first run the next request holds Celery's slot and waits for the replacement;
    the connection is lost meanwhile. Every call starts once."""
    from tests.apps import held_window

    try:
        subprocess.run(["rabbitmqctl", "status"], check=True, capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        pytest.skip("rabbitmqctl (to close a worker's connection) is not usable here")
    env = {
        "TEST_BROKER_URL": rabbitmq_url,
        "HELD_QUEUE": queue,
        "HELD_QUEUE_TYPE": "quorum",
        "HELD_SLOW_EXIT": "4",
    }
    publisher = Celery("publisher", broker=rabbitmq_url, set_as_current=False)
    arguments = held_window.queue_arguments("quorum", single_active=False)
    publisher.conf.task_queues = [Queue(queue, queue_arguments=arguments)]
    try:
        worker = workers.start(APP, concurrency=1, env=env, extra_args=["--max-tasks-per-child=1"])
        with publisher.producer_or_acquire() as producer:
            sent = [
                publisher.send_task(
                    held_window.quick.name, args=(n,), queue=queue, producer=producer
                ).id
                for n in range(CALLS)
            ]
        observer.starts_of("quick", 1, timeout=30)
        time.sleep(1.0)  # the first run's process is leaving; the next request waits
        assert _close_broker_connections(worker.pid) >= 1
        wait_until(
            lambda: {e["task_id"] for e in observer.started() if e["key"] == "quick"} >= set(sent),
            90,
            "every call started",
        )
        time.sleep(5.0)  # a second start of one would come with the next replacement
        starts = Counter(e["task_id"] for e in observer.started() if e["key"] == "quick")
        twice = sorted(task_id for task_id, n in starts.items() if n > 1)
        assert not twice, f"started twice: {twice}"
    finally:
        workers.stop_all(timeout=10)
        publisher.close()
