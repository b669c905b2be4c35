"""``baton unlock``: a forced unlock of a running task's lease is one incident, reported
once (issue 39 §4); ``unlock --task NAME`` and ``--all`` free what ``locks`` shows, in
place of celery-once's ``clear_locks(app)`` or a ``redis-cli DEL`` (issue 39 §3). Real
commands against a real worker holding real leases."""

from __future__ import annotations

import time

import pytest

from tests.ops.test_commands import as_json
from tests.support.observer import Observer
from tests.support.waiting import wait_until
from tests.support.workers import Workers

APP = "tests.apps.exclusive"


@pytest.mark.timeout(120)
def test_a_forced_unlock_of_a_running_lease_is_reported_once(
    workers: Workers, observer: Observer
) -> None:
    """Before: one pair of ERROR lines per renewal until the run ended (5 pairs for a
    run of 5 renewals), and the worker's losses counter said 5."""
    from tests.apps.exclusive import ex_skip

    # lease_ttl 1.5 s: a renewal every 0.5 s, many of them while the run goes on.
    worker = workers.start(APP, concurrency=1, env={"BATON_TEST_APP_LEASE_TTL": "1.5"})
    ex_skip.delay("unlocked", 30.0)
    observer.starts_of("unlocked")
    (lock,) = as_json(workers, "locks")
    assert as_json(workers, "unlock", lock["key"], "--force")["removed"] == 1
    wait_until(lambda: "lease lost" in worker.log_text(), 20, "the loss to be seen")
    time.sleep(3.0)  # six renewal intervals more
    log = worker.log_text()
    assert log.count("lease lost") == 1, log
    assert log.count("lost its lease") == 1, log
    worker.kill()  # the run would go on for 30 s; nothing more to see
