"""An app laid out as Celery's guide lays one out: its tasks in another module, named
by ``include=`` (imported by a worker at start, not by ``-A``)."""

from __future__ import annotations

from tests.apps.factory import make_baton_app

app, baton = make_baton_app("included", results=False)
app.conf.include = ["tests.apps.included_tasks"]
