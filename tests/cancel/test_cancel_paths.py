"""``baton.cancel`` on the admission paths that make no gate call of their own to check
it in (issue 38 §2): a debounced task that asks nothing more."""

from __future__ import annotations

from celery import states

from tests.support.observer import Observer
from tests.support.workers import Workers

APP = "tests.apps.cancel"


def test_a_cancelled_debounced_call_never_runs(workers: Workers, observer: Observer) -> None:
    from tests.apps import cancel

    gone = cancel.debounced.delay("a")
    cancel.baton.cancel(gone.id)
    kept = cancel.debounced.delay("b")
    # Started after the cancel: no notice, so the store says it (no gate call to ask).
    workers.start(APP, concurrency=2)
    assert kept.get(timeout=30) == "b"
    assert gone.state == states.REVOKED
    observer.wait_for(1, timeout=10)
    assert {s["task_id"] for s in observer.started()} == {kept.id}
