"""An app that names its store only in ``Baton(app, url=...)``: no ``baton_url``, no
``$BATON_URL``. Every part (worker, beat, schedule API, CLI) must use that store.

``TEST_GIVEN_STORE_URL`` is the URL handed to ``Baton``; beat publishes one entry every
second to the queue ``url_given`` (nothing consumes it: the test counts the messages).
"""

from __future__ import annotations

import os

from tests.apps.factory import make_baton_app

app, baton = make_baton_app(
    "url_given",
    results=False,
    store_from_env=False,
    url=os.environ["TEST_GIVEN_STORE_URL"],
    timezone="UTC",
    beat_scheduler="celery_baton.beat:Scheduler",
    beat_schedule={
        "every1": {
            "task": "tests.apps.url_given.tick",
            "schedule": 1.0,
            "options": {"queue": "url_given"},
        }
    },
)


@app.task
def tick() -> None:
    pass
