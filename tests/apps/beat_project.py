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

import json
import os
from typing import Any

from celery import Celery, Task
from celery.schedules import schedule

from tests.apps.factory import make_baton_app, observer


def project(main: str, entries: dict[str, float]) -> tuple[Celery, Any]:
    """The app named ``main`` whose beat fires ``beat.record(entry)`` every
    ``entries[entry]`` seconds; returns ``(app, record task)``."""
    beat_settings = {
        name.lower(): json.loads(value)
        for name, value in os.environ.items()
        if name.startswith("BATON_BEAT_")
    }
    app, _ = make_baton_app(
        main,
        store_from_env=False,  # found by Baton from $BATON_URL, as a user's would be
        timezone="UTC",
        beat_scheduler="celery_baton.beat:Scheduler",
        task_default_queue=main,
        result_expires=None,
        baton_socket_timeout=1.0,
        **beat_settings,
        beat_schedule={
            name: {"task": "beat.record", "schedule": schedule(every), "args": (name,)}
            for name, every in entries.items()
        },
    )

    @app.task(bind=True, name="beat.record", shared=False)
    def record(self: Task, entry: str, sleep: float = 0.0) -> None:
        slot = getattr(self.request, "baton_beat_slot", None)
        observer().run(f"{main}:{entry}|{slot}", sleep=sleep, task_id=self.request.id)

    return app, record
