"""A Celery app whose beat runs on celery-baton's Scheduler, configured from the env.

``BEAT_ENTRIES`` is a JSON object ``{name: {"every": seconds} | {"cron": "m h dom mon dow"},
"task": optional task name, "options": {...}}``; every entry defaults to the task
``tests.apps.beat_app.record``, which records one observed run keyed ``<entry>|<slot>``
(the slot comes from the message's ``baton_beat_slot`` header). ``BATON_BEAT_*`` env
variables become ``baton_beat_*`` settings; ``BEAT_CONF`` (JSON) any other settings.

Its workers install celery-baton (``Baton(app)``), as a user's must for a slot sent twice
(a leader killed or a master lost between the send and its record) to run once.
``BEAT_PLAIN_WORKERS=1`` leaves Celery plain: a test of what the beat itself sends counts
every copy that way.
"""

from __future__ import annotations

import json
import os
from typing import Any

from celery import Task
from celery.schedules import crontab, schedule

from tests.apps.factory import make_app, make_baton_app, observer

_CONF: dict[str, Any] = {
    "timezone": os.environ.get("BEAT_TIMEZONE", "UTC"),
    "beat_scheduler": "celery_baton.beat:Scheduler",
    "worker_prefetch_multiplier": 4,
    "result_expires": None,
}
if os.environ.get("BEAT_PLAIN_WORKERS") == "1":
    app = make_app("beat_app", **_CONF)
else:
    app, baton = make_baton_app("beat_app", **_CONF)
for name, value in os.environ.items():
    if name.startswith("BATON_BEAT_"):
        app.conf[name.lower()] = json.loads(value)
# For the benchmarks beside celery-redbeat (-S redbeat.RedBeatScheduler): same store.
app.conf.redbeat_redis_url = os.environ.get("BATON_URL")
app.conf.update(json.loads(os.environ.get("BEAT_CONF", "{}")))


def _schedule(spec: dict[str, Any]) -> Any:
    if "every" in spec:
        return schedule(float(spec["every"]))
    minute, hour, dom, month, dow = spec["cron"].split()
    return crontab(minute, hour, dow, dom, month)


app.conf.beat_schedule = {
    name: {
        "task": spec.get("task", "tests.apps.beat_app.record"),
        "schedule": _schedule(spec),
        "args": (name,),
        "options": spec.get("options", {}),
    }
    for name, spec in json.loads(os.environ.get("BEAT_ENTRIES", "{}")).items()
}


@app.task(bind=True)
def record(self: Task, entry: str, sleep: float = 0.0) -> None:
    """One observed run keyed ``<entry>|<slot ms>``."""
    slot = getattr(self.request, "baton_beat_slot", None)
    observer().run(f"{entry}|{slot}", sleep=sleep, task_id=self.request.id)
