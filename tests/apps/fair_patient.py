"""A Celery app with celery-baton whose workers wait 10 s for the store's answers
(``baton_socket_timeout``): a store paused for a few seconds delays the asks in flight
instead of failing them. One task: a cap of 2 shared by tenant (``fair_key``).

Run by workers as ``celery -A tests.apps.fair_patient worker``; reads the same
environment as ``tests.apps.fair``. Every run is reported to the observer under its
tenant's name (server clock).
"""

from __future__ import annotations

from celery import Task

from tests.apps.factory import make_baton_app, observer

CAP = 2

app, baton = make_baton_app(
    "fair_patient",
    results=False,
    baton_socket_timeout=10.0,
    task_acks_late=False,
    task_ignore_result=True,
)


@app.task(bind=True, global_concurrency=CAP, fair_key="tenant")
def fair_pair(self: Task, tenant: str, sleep: float) -> None:
    """At most 2 running anywhere, shared round-robin by tenant."""
    observer().run(tenant, sleep=sleep, task_id=self.request.id)
