"""celery-baton installed beside celery-singleton and celery-once: a task declared with
their options imports, the worker starts, and each task runs under its own extension
(issue 28 §7: ``unique_on`` was refused as a typo of ``unique`` at import)."""

from __future__ import annotations

import pytest

from tests.support.workers import Workers

pytest.importorskip("celery_singleton", reason="needs celery-singleton (the test extra)")
pytest.importorskip("celery_once", reason="needs celery_once (the test extra)")

APP = "tests.apps.extensions"


def test_tasks_of_other_extensions_import_and_run_beside_baton(workers: Workers) -> None:
    from tests.apps import extensions

    workers.start(APP, concurrency=2)
    assert extensions.singleton_feed.delay("a").get(timeout=30) == "singleton a"
    assert extensions.once_report.delay(7).get(timeout=30) == "once 7"
    assert extensions.baton_feed.delay("a").get(timeout=30) == "baton a"
