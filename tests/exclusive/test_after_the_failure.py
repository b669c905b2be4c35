"""An exclusive key is free for a caller who saw its run fail in the main process.

A run whose pool process died ends in Celery's main process, which stores its FAILURE
(``WorkerLostError``); a caller who sees it and publishes the key again, to another
worker, must get a run, not a skip as a duplicate of the run that failed.
"""

from __future__ import annotations

import pytest
from billiard.exceptions import WorkerLostError

from tests.support.workers import Workers

APP = "tests.apps.run_ends"
TRIES = 12


@pytest.mark.timeout(300)
def test_a_publish_to_another_worker_after_a_lost_process_failure_runs(
    workers: Workers,
) -> None:
    from tests.apps import run_ends

    workers.start(APP, concurrency=2, queues="a")
    workers.start(APP, concurrency=2, queues="b")
    skipped = []
    for n in range(TRIES):
        first = run_ends.ex_process_killed.apply_async((f"x{n}", True), queue="a")
        with pytest.raises(WorkerLostError):
            first.get(timeout=60)
        again = run_ends.ex_process_killed.apply_async((f"x{n}", False), queue="b")
        try:
            assert again.get(timeout=60) == "ran"
        except Exception as exc:  # TaskSkipped: held by the run that failed
            skipped.append(repr(exc))
    assert not skipped, f"{len(skipped)} of {TRIES} runs after the failure skipped: {skipped[:2]}"
