"""An app whose task names a limit ``baton_limits`` does not have (a typo), declared
before the app's conf has its limits (as with settings read late): the worker must
refuse to start, naming the limit and the one it probably meant."""

from __future__ import annotations

import os

from celery import Celery

from celery_baton import Baton

app = Celery("shared_limits_typo", broker=os.environ["TEST_BROKER_URL"])
app.conf.update(baton_url=os.environ["BATON_URL"], broker_connection_retry_on_startup=True)
baton = Baton(app)


@app.task(limits=["opneai"])
def summarize(text: str) -> None: ...


app.conf.baton_limits = {"openai": "90000/m"}  # known only now: checked at worker start
