"""The run that ``exclusive_conflict="replace"`` stopped resolves to ``TaskSuperseded``
naming the task that replaced it, as docs/guides/supersede.md promises for every
superseded id: for a caller already waiting on it and for one asking later; Celery's own
``TaskRevokedError`` (no ``replaced_by``) must not be what they get (issue 28 §9).

Real workers; the outside observer sees the run start before it is replaced."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from celery_baton import TaskSuperseded
from tests.support.observer import Observer
from tests.support.workers import Workers

APP = "tests.apps.supersede"


def _outcome(result: Any) -> BaseException | object:
    try:
        return result.get(timeout=30)
    except Exception as exc:
        return exc


@pytest.mark.timeout(120)
@pytest.mark.parametrize("worker_count", [1, 2], ids=["one-worker", "two-workers"])
def test_the_stopped_run_resolves_to_task_superseded_naming_the_replacing_id(
    workers: Workers, observer: Observer, worker_count: int
) -> None:
    from tests.apps.supersede import ex_replace

    for _ in range(worker_count):
        workers.start(APP, concurrency=2)
    key = f"stopped{worker_count}"
    first = ex_replace.delay(key, 0, 60)
    observer.starts_of(key)  # running: the next publish stops it
    waited: list[BaseException | object] = []
    waiter = threading.Thread(target=lambda: waited.append(_outcome(first)))
    waiter.start()

    second = ex_replace.delay(key, 1, 0.2)
    assert second.get(timeout=30) == 1
    waiter.join(40)

    late = ex_replace.AsyncResult(first.id)  # a caller asking once it is over
    for outcome in (waited[0], _outcome(late)):
        assert isinstance(outcome, TaskSuperseded), repr(outcome)
        assert outcome.replaced_by == second.id
    assert ex_replace.AsyncResult(first.id).state == "REVOKED"
