"""A Celery app whose broker and store are reached over TLS (``rediss://``), as managed
Redis services are: every connection celery-baton makes (the store's, the worker's own
to the broker for kombu's writes) goes through an ``SSLSocket``, whose records the
event loop cannot see by the socket alone.

Run by workers as ``celery -A tests.apps.tls worker``. Reads ``TEST_TLS_BROKER_URL``,
``TEST_TLS_STORE_URL``, ``TEST_TLS_CA`` (the servers' certificate),
``TEST_RESULT_URL`` and ``TEST_OBSERVER_URL`` from the environment. In the test process,
import it inside a test that has set them.
"""

from __future__ import annotations

import os
import ssl
import time

from celery import Celery, Task

from celery_baton import Baton
from tests.apps.factory import fenced_run, observer

CA = os.environ["TEST_TLS_CA"]

app = Celery("tls", broker=os.environ["TEST_TLS_BROKER_URL"], backend=os.environ["TEST_RESULT_URL"])
app.conf.update(
    broker_use_ssl={"ssl_cert_reqs": ssl.CERT_REQUIRED, "ssl_ca_certs": CA},
    broker_connection_retry_on_startup=True,
    baton_url=f"{os.environ['TEST_TLS_STORE_URL']}?ssl_ca_certs={CA}&ssl_cert_reqs=required",
)
baton = Baton(app)


@app.task(bind=True, exclusive="key")
def ex_skip(self: Task, key: str, sleep: float = 0.0) -> int:
    """One observed run of ``key``; a duplicate is skipped."""
    return fenced_run(self, key, sleep)


@app.task(bind=True, global_rate_limit="100/s")
def rated(self: Task, key: str) -> str:
    observer().run(key, task_id=self.request.id)
    return key


@app.task(bind=True, redelivery_guard=True, acks_late=True)
def guarded(self: Task, key: str) -> str:
    observer().run(key, task_id=self.request.id)
    return key


@app.task
def sleeper(seconds: float) -> None:
    time.sleep(seconds)
