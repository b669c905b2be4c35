"""A Celery app with celery-baton installed whose workers shut down the way production
deployments stop them: a cold shutdown (SIGQUIT, or SIGTERM with
``REMAP_SIGTERM=SIGQUIT``) after Celery 5.5's soft shutdown
(``worker_soft_shutdown_timeout``): the running tasks get that long to end, then Celery
cancels each ``acks_late`` one still running (``Consumer.cancel_active_requests``) and
its message, unacknowledged, goes back to the broker for another worker.

Run by workers as ``celery -A tests.apps.cold_shutdown worker``. Reads
``TEST_BROKER_URL``, ``TEST_RESULT_URL``, ``TEST_OBSERVER_URL`` and ``BATON_URL`` from
the environment. In the test process, import it inside a test that uses the
``app_environ`` fixture.
"""

from __future__ import annotations

from celery import Task

from celery_baton import fence
from tests.apps.factory import make_baton_app, observer

app, baton = make_baton_app(
    "cold_shutdown",
    task_acks_late=True,
    worker_soft_shutdown_timeout=1.0,
    broker_transport_options={"visibility_timeout": 3600},
)


@app.task(bind=True, exclusive="key", exclusive_conflict="wait", redelivery_guard=True)
def ex_guarded(self: Task, key: str, seconds: float) -> int:
    """One observed run of ``key`` for ``seconds``."""
    token = fence()
    observer().run(key, token, sleep=seconds, task_id=self.request.id)
    return token


@app.task(bind=True)
def plain(self: Task, key: str, seconds: float) -> int:
    """The same with no option: what Celery alone does with the message."""
    observer().run(key, 0, sleep=seconds, task_id=self.request.id)
    return 0
