"""``fence()`` under ``.apply()``, eager mode and direct calls (issue 13 §7): a token that
grows like a real one, so code that guards its writes can be tested without a worker."""

from __future__ import annotations

import pytest
from celery import Celery

from celery_baton import Baton, NotInExclusiveTask, fence


def test_fence_in_runs_no_worker_admitted() -> None:
    app = Celery("fence_eager", set_as_current=False)
    Baton(app, url="redis://127.0.0.1:1/0")  # never connected: nothing here needs it

    @app.task(exclusive="key")
    def guarded(key: str) -> int:
        return fence()

    @app.task
    def plain() -> int:
        return fence()

    first = guarded.apply(("k",)).get()
    second = guarded.apply(("k",)).get()
    assert 0 < first < second
    assert second < guarded("k")  # a direct call, as in a unit test of the task
    with pytest.raises(NotInExclusiveTask):
        plain.apply().get()
    with pytest.raises(NotInExclusiveTask):
        fence()  # outside any task
