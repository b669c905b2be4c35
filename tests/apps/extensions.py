"""celery-baton beside celery-singleton and celery-once, as while migrating
(docs/migration.md): their tasks keep their own options (``unique_on``, ``once``) and
run; a celery-baton task runs beside them (issue 28 §7)."""

from __future__ import annotations

import os

from celery import Celery
from celery_once import QueueOnce
from celery_singleton import Singleton

from celery_baton import Baton

app = Celery(
    "extensions",
    broker=os.environ["TEST_BROKER_URL"],
    backend=os.environ.get("TEST_RESULT_URL"),
)
app.conf.update(
    baton_url=os.environ["BATON_URL"],
    broker_connection_retry_on_startup=True,
    singleton_backend_url=os.environ["BATON_URL"],
    singleton_key_prefix="test-singleton:",
    ONCE={
        "backend": "celery_once.backends.Redis",
        "settings": {"url": os.environ["BATON_URL"], "default_timeout": 60},
    },
)
baton = Baton(app)


@app.task(base=Singleton, unique_on=["feed_url"], lock_expiry=60)
def singleton_feed(feed_url: str) -> str:
    return f"singleton {feed_url}"


@app.task(base=QueueOnce, once={"keys": ["report_id"], "graceful": True})
def once_report(report_id: int) -> str:
    return f"once {report_id}"


@app.task(exclusive="feed_url")
def baton_feed(feed_url: str) -> str:
    return f"baton {feed_url}"
