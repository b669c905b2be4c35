"""A pool that cannot hold a promise is refused at worker start, in one line (issue 34).

# assumes: only a pool with its own ``terminate_job`` can stop a running task. Celery's
# threads and solo pools have none (``BasePool.terminate_job`` raises), so the run an
# ``exclusive_conflict="replace"`` delivery replaces would go on to its end.
"""

from __future__ import annotations

import pytest

from tests.ops.test_bad_input import _one_line
from tests.support.waiting import wait_until
from tests.support.workers import Workers

APP = "tests.apps.pools"


@pytest.mark.parametrize("pool", ["threads", "solo"])
def test_replace_on_a_pool_that_cannot_stop_a_run_is_refused_in_one_line(
    pool: str, workers: Workers
) -> None:
    worker = workers.start(APP, wait=False, pool=pool, concurrency=2)
    wait_until(lambda: not worker.is_running, 60, f"{worker!r} to refuse")
    log = worker.log_text()
    assert worker.returncode != 0
    assert "Traceback" not in log, log
    refusal = [line for line in _one_line(log) if "exclusive_conflict='replace'" in line]
    assert len(refusal) == 1, log
    assert f"the {pool} pool cannot stop a running task" in refusal[0]
    assert "tests.apps.pools.replaced" in refusal[0]
