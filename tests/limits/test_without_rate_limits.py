"""``worker_disable_rate_limits`` (Celery 4's ``--without-rate-limits``) with
``baton_global_rate_limits``: a worker does not enforce Celery's ``rate_limit``, as
without celery-baton, though celery-baton made it global; a ``global_rate_limit``
(celery-baton's own option, which the flag does not name) still holds.

Judged by the observer's starts: three calls of a task whose ``rate_limit`` is 1/m all
start, two of one whose ``global_rate_limit`` is 1/m start one.
"""

from __future__ import annotations

import time

import pytest

from tests.support.observer import Observer
from tests.support.workers import Workers

APP = "tests.apps.limits"


@pytest.mark.timeout(120)
def test_a_worker_without_rate_limits_does_not_enforce_celerys_rate_limit(
    workers: Workers, observer: Observer
) -> None:
    from tests.apps.limits import celery_crawl, crawl

    worker = workers.start(APP, concurrency=2, env={"LIMITS_NO_RATE_LIMITS": "1"})
    for _ in range(3):
        celery_crawl.delay()
    for _ in range(2):
        crawl.delay()
    assert len(observer.starts_of("celery_crawl", 3, timeout=30)) == 3
    observer.starts_of("crawl", 1, timeout=30)
    time.sleep(2.0)  # the second would start now, were the global limit not held
    assert len([s for s in observer.started() if s["key"] == "crawl"]) == 1
    assert "rate_limit is not enforced" in worker.log_text()
