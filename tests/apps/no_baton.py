"""An app whose task declares celery-baton options but that never calls ``Baton(app)``."""

from __future__ import annotations

import os

from celery import Celery

app = Celery("no_baton", broker=os.environ["TEST_BROKER_URL"])
app.conf.broker_connection_retry_on_startup = True


@app.task(unique="report_id")
def build_report(report_id: int) -> int:
    return report_id
