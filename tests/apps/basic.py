"""A plain Celery app (no celery-baton) for testing the test infrastructure itself.

Run by workers as ``celery -A tests.apps.basic worker``; reads ``TEST_BROKER_URL``,
``TEST_RESULT_URL`` and ``TEST_OBSERVER_URL`` from the environment (see
``tests.support.celery_processes.app_env``). In the test process, import it inside a
test that uses the ``app_environ`` fixture (or any fixture built on it), which sets those
variables.
"""

from __future__ import annotations

from celery import Task

from tests.apps.factory import make_app, observer

app = make_app(
    "basic",
    task_acks_late=False,
    broker_transport_options={"visibility_timeout": 3600},
)


@app.task
def noop() -> None:
    """Does nothing."""


@app.task(bind=True)
def observed(self: Task, key: str, sleep: float = 0.0) -> None:
    """One observed run of ``key`` lasting ``sleep`` seconds."""
    observer().run(key, sleep=sleep, task_id=self.request.id)
