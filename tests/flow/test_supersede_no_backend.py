"""Without a result backend, a replace is silent (issue 39 §4): every
``exclusive_conflict="replace"`` logged ``ERROR baton: could not record ... as
superseded`` with a traceback (``'DisabledBackend' object has no attribute
'_get_task_meta_for'``), though there is nothing to record it in."""

from __future__ import annotations

from tests.support.observer import Observer
from tests.support.workers import Workers


def test_a_replace_without_a_result_backend_logs_no_error(
    workers: Workers, observer: Observer
) -> None:
    from tests.apps.supersede_no_results import replaced

    worker = workers.start("tests.apps.supersede_no_results", concurrency=2)
    replaced.delay("nb", 0, 30.0)
    observer.starts_of("nb")
    replaced.delay("nb", 1, 0.1)
    (run,) = observer.runs_of("nb", timeout=30)  # the newest ran; the first was stopped
    assert run.fence == 1
    log = worker.log_text()
    assert "could not record" not in log and "Traceback" not in log, log
