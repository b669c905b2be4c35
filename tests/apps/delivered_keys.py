"""A Celery app with celery-baton installed whose keys are built at the publish
(``unique``, ``ordered``, ``debounce``) over arguments the serializer changes on the way
to the worker: a tuple is read as a list (json, msgpack), so ``"{pair}"`` is the text
``(1, 2)`` in the publisher and ``[1, 2]`` in the worker.

Run by workers as ``celery -A tests.apps.delivered_keys worker``. Reads
``TEST_BROKER_URL``, ``TEST_RESULT_URL``, ``TEST_OBSERVER_URL`` and ``BATON_URL`` from
the environment, and ``TEST_SERIALIZER`` (default: Celery's, json). In the test
process, import it inside a test that uses the ``app_environ`` fixture.
"""

from __future__ import annotations

import os
from typing import Any

from celery import Task

from tests.apps.factory import make_baton_app, observer

SERIALIZER = os.environ.get("TEST_SERIALIZER", "json")

app, baton = make_baton_app(
    "delivered_keys",
    # A worker takes messages of this serializer only; results stay json.
    task_serializer=SERIALIZER,
    accept_content=[SERIALIZER],
    task_create_missing_queues=True,
    worker_lost_wait=1.0,
)


@app.task(bind=True, unique="{pair}")
def uq_template(self: Task, pair: Any) -> str:
    """Unique over a template of ``pair``: returns its own id."""
    return str(self.request.id)


@app.task(bind=True, unique=lambda pair: f"pair={pair}")
def uq_function(self: Task, pair: Any) -> str:
    """Unique over a key function of ``pair``: returns its own id."""
    return str(self.request.id)


@app.task(bind=True, ordered="{pair}")
def ord_template(self: Task, pair: Any, n: int) -> int:
    """Call ``n`` of ``pair``'s line: one observed run."""
    observer().run(f"ord-{list(pair)}", None, task_id=self.request.id)
    return n


@app.task(bind=True, debounce=1.0, debounce_key="{pair}")
def deb_template(self: Task, pair: Any, n: int) -> int:
    """Debounced per ``pair``: one observed run per burst, with the latest ``n``."""
    observer().run(f"deb-{list(pair)}-{n}", None, task_id=self.request.id)
    return n
