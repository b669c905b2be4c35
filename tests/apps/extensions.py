"""celery-baton beside celery-singleton and celery-once, as while migrating
(docs/migration.md): their tasks keep their own options (``unique_on``, ``once``) and
run; a celery-baton task runs beside them (issue 28 §7)."""

from __future__ import annotations

import os

from celery_once import QueueOnce
from celery_singleton import Singleton

from tests.apps.factory import make_baton_app

app, baton = make_baton_app(
    "extensions",
    singleton_backend_url=os.environ["BATON_URL"],
    singleton_key_prefix="test-singleton:",
    ONCE={
        "backend": "celery_once.backends.Redis",
        "settings": {"url": os.environ["BATON_URL"], "default_timeout": 60},
    },
)


@app.task(base=Singleton, unique_on=["feed_url"], lock_expiry=60)
def singleton_feed(feed_url: str) -> str:
    return f"singleton {feed_url}"


@app.task(base=QueueOnce, once={"keys": ["report_id"], "graceful": True})
def once_report(report_id: int) -> str:
    return f"once {report_id}"


@app.task(exclusive="feed_url")
def baton_feed(feed_url: str) -> str:
    return f"baton {feed_url}"
