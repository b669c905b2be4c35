"""One "project" of the beat tests: a Celery app with celery-baton installed (worker
admission included) and its own ``beat_schedule``, built by :func:`project`.

``tests.apps.beat_alpha`` and ``tests.apps.beat_beta`` are two such projects with
different app names (``app.main``) and schedules, pointed at one store with the default
key prefix, as two projects on one developer's machine share the embedded store. Each
consumes its own queue (named after the app), so each project's worker runs only its
own messages; both declare the task ``beat.record`` under the same name, as two projects
often do.

``beat.record`` records one observed run keyed ``<app>:<entry>|<slot>`` (the slot comes
from the message's ``baton_beat_slot`` header). ``BATON_BEAT_*`` env variables become
``baton_beat_*`` settings.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

from celery import Celery, Task
from celery.schedules import schedule

from celery_baton import Baton
from tests.support.observer import Observer


@functools.cache
def observer() -> Observer:
    """This process's Observer (created after the pool forked, so never shared)."""
    return Observer(os.environ["TEST_OBSERVER_URL"])


def project(main: str, entries: dict[str, float]) -> tuple[Celery, Any]:
    """The app named ``main`` whose beat fires ``beat.record(entry)`` every
    ``entries[entry]`` seconds; returns ``(app, record task)``."""
    app = Celery(
        main, broker=os.environ["TEST_BROKER_URL"], backend=os.environ.get("TEST_RESULT_URL")
    )
    app.conf.update(
        timezone="UTC",
        beat_scheduler="celery_baton.beat:Scheduler",
        task_default_queue=main,
        broker_connection_retry_on_startup=True,
        result_expires=None,
        baton_socket_timeout=1.0,
    )
    for name, value in os.environ.items():
        if name.startswith("BATON_BEAT_"):
            app.conf[name.lower()] = json.loads(value)
    app.conf.beat_schedule = {
        name: {"task": "beat.record", "schedule": schedule(every), "args": (name,)}
        for name, every in entries.items()
    }
    Baton(app)

    @app.task(bind=True, name="beat.record", shared=False)
    def record(self: Task, entry: str, sleep: float = 0.0) -> None:
        slot = getattr(self.request, "baton_beat_slot", None)
        observer().run(f"{main}:{entry}|{slot}", sleep=sleep, task_id=self.request.id)

    return app, record
