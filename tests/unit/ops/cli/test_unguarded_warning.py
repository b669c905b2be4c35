"""``celery -A proj baton ...`` on an app that never called ``Baton(app)`` warns, naming
the tasks whose options do nothing there (ops/cli/group.py). No server."""

from __future__ import annotations

from celery import Celery

from celery_baton import Baton
from celery_baton.ops.cli.group import unguarded_tasks


def test_an_app_without_baton_lists_its_tasks_that_declare_options() -> None:
    app = Celery("forgot", set_as_current=False)

    @app.task(unique="report_id", shared=False)
    def build_report(report_id: int) -> None: ...

    @app.task(shared=False)
    def plain(x: int) -> None: ...

    # (other tests' shared tasks may be registered in every app: only these two matter)
    unguarded = unguarded_tasks(app)
    assert build_report.name in unguarded and plain.name not in unguarded, unguarded


def test_an_app_with_baton_has_none() -> None:
    app = Celery("installed", set_as_current=False)
    Baton(app, url="redis://127.0.0.1:1/0")  # never connected

    @app.task(unique="report_id", shared=False)
    def build_report(report_id: int) -> None: ...

    assert unguarded_tasks(app) == []
