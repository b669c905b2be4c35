"""An app whose conf has the ``baton_*`` settings of ``$BAD_SETTINGS`` (JSON): typos or
bad values on purpose. The worker and beat must refuse to start with one line naming
every bad setting, not a traceback (issue 28 §5)."""

from __future__ import annotations

import json
import os

from celery import Celery

from celery_baton import Baton

app = Celery("bad_settings", broker=os.environ["TEST_BROKER_URL"])
app.conf.update(baton_url=os.environ["BATON_URL"], broker_connection_retry_on_startup=True)
app.conf.update(json.loads(os.environ.get("BAD_SETTINGS", "{}")))
baton = Baton(app)


@app.task(exclusive="feed_url")
def import_feed(feed_url: str) -> None: ...
