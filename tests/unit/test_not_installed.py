"""A task declaring celery-baton options on an app that never called ``Baton(app)``:
``unique=`` does nothing there. The first publish says so, once, naming the task
(issue 39 §2); the worker says so at start (tests/worker/test_declaration.py)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from celery import Celery

import celery_baton  # noqa: F401  (the publisher imported celery-baton, not Baton(app))
from celery_baton import Baton


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("forgotten", broker="memory://", set_as_current=True)
    app.conf.task_always_eager = False
    yield app


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if "Baton(app) was never called" in r.getMessage()
    ]


def test_the_first_publish_of_an_app_without_baton_says_so_once(
    app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="celery_baton")

    @app.task(shared=False, unique="report_id")
    def build_report(report_id: int) -> int:
        return report_id

    @app.task(shared=False)
    def plain() -> None: ...

    plain.delay()
    assert not _warnings(caplog)
    for _ in range(3):
        build_report.delay(7)
    warned = _warnings(caplog)
    assert len(warned) == 1, warned
    assert build_report.name in warned[0] and "UNGUARDED" in warned[0]


def test_an_app_with_baton_publishes_without_that_warning(
    app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="celery_baton")
    Baton(app, url="redis://127.0.0.1:1/0")

    @app.task(shared=False, exclusive=True)
    def import_feed() -> None: ...

    import_feed.delay()
    assert not _warnings(caplog)


def test_an_eager_run_of_a_coordinated_task_says_it_is_not_coordinated_once(
    app: Celery, caplog: pytest.LogCaptureFixture
) -> None:
    """``task_always_eager`` (common in test settings): each ``delay()`` runs in the
    caller, with no deduplication, lease or limit. Said once per task, naming its
    options; a plain task's eager run and a coordinated task's ``.delay()`` without
    eager say nothing."""
    caplog.set_level(logging.WARNING, logger="celery_baton")
    Baton(app, url="redis://127.0.0.1:1/0")

    @app.task(shared=False, unique="report_id")
    def build_eager_report(report_id: int) -> int:
        return report_id

    @app.task(shared=False)
    def plain_eager() -> None: ...

    app.conf.task_always_eager = True
    plain_eager.delay()
    for _ in range(3):
        assert build_eager_report.delay(7).get() == 7
    said = [r.getMessage() for r in caplog.records if "ran eagerly" in r.getMessage()]
    assert len(said) == 1, said
    assert build_eager_report.name in said[0] and "unique" in said[0]
