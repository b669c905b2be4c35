"""The tasks of ``tests.apps.included`` (imported through its ``include``)."""

from __future__ import annotations

from tests.apps.included import app


@app.task(global_rate_limit="2/s")
def fetch(url: str) -> str:
    return url
