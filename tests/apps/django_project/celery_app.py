"""The Celery app of the test Django project (``celery -A tests.apps.django_project.celery_app``).

Its beat is ``celery_baton.beat.django:DjangoScheduler`` (settings.py); its one task
records a run keyed ``<entry>|<slot ms>`` with the observer, as tests/apps/beat_app.py.
"""

from __future__ import annotations

import os

from celery import Celery, Task

from celery_baton import Baton
from tests.apps.factory import observer

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.apps.django_project.settings")

app = Celery("djbeat")
app.config_from_object("django.conf:settings", namespace="CELERY")
# The workers run celery-baton too (docs/guides/django-beat.md): a slot the new leader
# sends again after a leader died is admitted once by its task id. (Without it, a CI
# rehearsal ran a re-sent slot twice.)
Baton(app)


@app.task(bind=True)
def record(self: Task, entry: str) -> None:
    """One observed run keyed ``<entry>|<slot ms>`` (the slot from the message's header)."""
    slot = getattr(self.request, "baton_beat_slot", None)
    observer().run(f"{entry}|{slot}", task_id=self.request.id)
