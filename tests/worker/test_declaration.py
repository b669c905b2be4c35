"""A worker whose tasks declare celery-baton options on an app without ``Baton(app)``
says so at start, naming the tasks (issue 13 §2): ``unique`` must not be a silent no-op."""

from __future__ import annotations

from tests.support.waiting import wait_until
from tests.support.workers import Workers


def test_options_on_an_app_without_baton_are_a_warning_naming_the_task(
    workers: Workers,
) -> None:
    worker = workers.start("tests.apps.no_baton", concurrency=1)
    wait_until(
        lambda: "Baton(app) was never called" in worker.log_text(), timeout=20, what="warning"
    )
    assert "tests.apps.no_baton.build_report" in worker.log_text()
