"""An app whose task declares celery-baton options but that never calls ``Baton(app)``."""

from __future__ import annotations

from tests.apps.factory import make_app

app = make_app("no_baton", results=False)


@app.task(unique="report_id")
def build_report(report_id: int) -> int:
    return report_id
