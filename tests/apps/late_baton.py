"""An app whose task is declared with the options of ``$DECLARED`` (JSON), before
``Baton(app)`` when ``$BATON_ORDER`` is ``after`` (the default), after it when ``first``:
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
if os.environ.get("BATON_ORDER", "after") == "first":
    baton = Baton(app)


@app.task(**options)
def import_feed(feed_url: str) -> None: ...


if os.environ.get("BATON_ORDER", "after") == "after":
    baton = Baton(app)
