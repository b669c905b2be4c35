"""An app whose conf has the ``baton_*`` settings of ``$BAD_SETTINGS`` (JSON): typos or
bad values on purpose. The worker and beat must refuse to start with one line naming
every bad setting, not a traceback (issue 28 §5)."""

from __future__ import annotations

import json
import os

from tests.apps.factory import make_baton_app

app, baton = make_baton_app(
    "bad_settings", results=False, **json.loads(os.environ.get("BAD_SETTINGS", "{}"))
)


@app.task(exclusive="feed_url")
def import_feed(feed_url: str) -> None: ...
