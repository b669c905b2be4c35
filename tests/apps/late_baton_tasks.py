"""``tests.apps.late_baton``'s task when ``$BATON_ORDER`` is ``include``."""

from __future__ import annotations

from tests.apps.late_baton import app, options


@app.task(**options)
def import_feed(feed_url: str) -> None: ...
