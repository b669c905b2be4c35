"""An app whose task is declared with the options of ``$DECLARED`` (JSON), before
``Baton(app)`` when ``$BATON_ORDER`` is ``after`` (the default), after it when ``first``,
in a module of ``include=`` when ``include``:
a bad option must stop a worker, beat and the CLI with one line either way (issue 39
§2, §5)."""

from __future__ import annotations

import json
import os
from typing import Any

from celery_baton import Baton
from tests.apps.factory import make_app

app = make_app("late_baton", results=False, baton_url=os.environ.get("BATON_URL"))
options: dict[str, Any] = json.loads(os.environ.get("DECLARED", "{}"))
ORDER = os.environ.get("BATON_ORDER", "after")
if ORDER in ("first", "include"):
    baton = Baton(app)
if ORDER == "include":  # declared in a module a worker imports at start, not `-A`
    app.conf.include = ["tests.apps.late_baton_tasks"]
else:

    @app.task(**options)
    def import_feed(feed_url: str) -> None: ...


if ORDER == "after":
    baton = Baton(app)
