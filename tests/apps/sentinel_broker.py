"""A Celery app whose broker is a Redis Sentinel service (``sentinel://``, kombu's
transport with ``master_name``): after a failover kombu finds the new master through
the sentinels, and so must every connection the worker makes to the broker itself
(its own writes: records and acks, worker/transport/broker_writes.py).

Run by workers as ``celery -A tests.apps.sentinel_broker worker``. Reads
``TEST_SENTINEL_BROKER_URL`` (kombu's ``sentinel://h:p;sentinel://h:p/db``),
``TEST_SENTINEL_SERVICE``, ``TEST_RESULT_URL``, ``TEST_OBSERVER_URL`` and
``BATON_URL``. In the test process, import it inside a test that has set them.
"""

from __future__ import annotations

import os

from celery import Celery, Task

from celery_baton import Baton
from tests.apps.factory import observer

app = Celery(
    "sentinel_broker",
    broker=os.environ["TEST_SENTINEL_BROKER_URL"],
    backend=os.environ["TEST_RESULT_URL"],
)
app.conf.update(
    broker_transport_options={
        "master_name": os.environ["TEST_SENTINEL_SERVICE"],
        "visibility_timeout": 20,
        "unacked_restore_interval": 1,
    },
    broker_connection_retry_on_startup=True,
    baton_url=os.environ["BATON_URL"],
)
baton = Baton(app)


@app.task(bind=True, redelivery_guard=True, acks_late=True)
def guarded(self: Task, key: str, sleep: float = 0.0) -> str:
    """One observed run of ``key``; a copy of its message is refused."""
    observer().run(key, sleep=sleep, task_id=self.request.id)
    return key
