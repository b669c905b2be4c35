"""What the tests of a run's end lost with the store share
(tests/failover/test_sentinel_records.py, tests/failover/test_store_forgets_ends.py):
where the end's record is, and the judgement of the copy the broker gives back."""

from __future__ import annotations

import time

from tests.support.celery_processes import WorkerProcess
from tests.support.observer import Observer
from tests.support.servers import StoreServer
from tests.support.waiting import wait_until

#: The worker's line once Celery gave up the ack; its main process records the end then.
ACK_FAILED = "ended but its ack failed"


def holds_done_marker(server: StoreServer, task_id: str) -> bool:
    """Whether ``server`` holds the redelivery guard's done marker of ``task_id``."""
    with server.client() as r:
        return any(":done:" in key for key in r.scan_iter(f"*{task_id}*"))


def assert_the_copy_does_not_run(worker: WorkerProcess, observer: Observer, task_id: str) -> None:
    """The broker gives the message back (the app's visibility_timeout, 10 s): its copy
    must be acked without running, not run (the record lost with the store)."""
    wait_until(
        lambda: f"{task_id}] skipped" in worker.log_text() or len(observer.started()) > 1,
        90,
        "the copy to be judged",
    )
    time.sleep(1.0)  # a copy run after all would have started by now
    assert [s["task_id"] for s in observer.started()] == [task_id], (
        "the copy of a run whose end was recorded ran again"
    )
