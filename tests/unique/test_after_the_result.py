"""A publish made after the caller saw the result is a new run (issue 35.5).

``r.get(); f.delay(k)``: the caller saw the run end, so the key must be free. It was
freed after the result was stored (by the pool process in ``task_postrun``, or by the
main process after the ack), and 16-27 % of such publishes were deduplicated into the
finished task: the caller got its id back, and no new run. The claim is now freed
before the result is stored.
"""

from __future__ import annotations

import time

import pytest

from tests.support.workers import Workers

APP = "tests.apps.run_ends"
TRIES = 200


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("task_name", "pool"),
    [
        ("uq_quick", "prefork"),
        ("uq_quick_guarded", "prefork"),
        ("uq_quick_late", "prefork"),
        # The task runs in the main process: its end is recorded there, before the result.
        ("uq_quick", "solo"),
        ("uq_quick_late", "threads"),
    ],
)
def test_a_publish_after_get_returned_is_a_new_run(
    workers: Workers, task_name: str, pool: str
) -> None:
    from tests.apps import run_ends

    task = getattr(run_ends, task_name)
    workers.start(APP, concurrency=2, pool=pool)
    previous = task.delay("k")
    assert previous.get(timeout=60) == previous.id
    deduplicated = 0
    for _ in range(TRIES):
        result = task.delay("k")
        if result.id == previous.id:
            deduplicated += 1
            time.sleep(0.1)  # one late free counted once, not once per publish meanwhile
            continue
        assert result.get(timeout=20) == result.id
        previous = result
    assert deduplicated == 0, f"{deduplicated} of {TRIES} publishes got the finished task"
