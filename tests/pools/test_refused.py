"""A pool that cannot hold a promise is refused at worker start, in one line (issue 34).

# assumes: only a pool with its own ``terminate_job`` can stop a running task. Celery's
# threads and solo pools have none (``BasePool.terminate_job`` raises), so the run an
# ``exclusive_conflict="replace"`` delivery replaces would go on to its end.
"""

from __future__ import annotations

import pytest

from tests.ops.test_bad_input import _one_line
from tests.pools.test_green import CLEANUP, assert_stopped_before_next
from tests.support.observer import Observer
from tests.support.servers import StoreServer
from tests.support.waiting import revoke_until_heard, wait_until
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


@pytest.mark.parametrize("pool", ["threads", "solo"])
def test_revoke_terminate_on_a_pool_that_cannot_stop_keeps_the_key_until_the_body_returns(
    pool: str, workers: Workers, observer: Observer, broker_server: StoreServer
) -> None:
    """Celery cannot stop the run (threads: ``terminate_job`` raises; solo: the loop reads
    no control command while a body runs): it goes on to its end, and the waiting run of
    its key starts only after it."""
    from tests.apps.pools import STOPPABLE_QUEUE, app, stoppable

    workers.start(APP, pool=pool, concurrency=4, queues=STOPPABLE_QUEUE)
    first = stoppable.delay("t", 0, 2.0, CLEANUP)
    observer.starts_of("t")
    waiting = stoppable.delay("t", 1, 0.2)
    revoke_until_heard(app, first.id, terminate=True)

    assert waiting.get(timeout=30) == 1
    (old,) = [r for r in observer.runs_of("t", 2) if r.task_id.endswith(":0")]
    assert old.end - old.start >= 1.9e6  # not stopped: it ran its 2 s
    assert_stopped_before_next(observer, broker_server, "t")
