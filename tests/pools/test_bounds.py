"""The bound of a global limit at the task body's start, on every way Celery runs a task,
judged by the observer (issue 34: gevent and threads held it; keep them so), and on
prefork recycled (``--max-tasks-per-child``) or grown and shrunk (``--autoscale``)."""

from __future__ import annotations

import importlib.util

import pytest

from tests.support.observer import Observer, max_concurrent
from tests.support.pools import pool_setting
from tests.support.workers import Workers

APP = "tests.apps.pools"


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("pool", "concurrency"),
    [
        ("prefork", 4),
        ("gevent", 8),
        pytest.param(
            "eventlet",
            8,
            marks=pytest.mark.skipif(
                importlib.util.find_spec("eventlet") is None, reason="eventlet is not installed"
            ),
        ),
        ("solo", 1),
        ("threads", 4),
        pytest.param("prefork --max-tasks-per-child 2", 4, id="prefork-recycled-4"),
        pytest.param("prefork --autoscale 4,1", 4, id="prefork-autoscale-4"),
        pytest.param("prefork --max-memory-per-child 1", 4, id="prefork-memory-recycled-4"),
    ],
)
def test_global_concurrency_holds_at_start_on_each_pool(
    pool: str, concurrency: int, workers: Workers, observer: Observer
) -> None:
    """300 runs of 20 ms under ``global_concurrency=2`` over 3 workers: at most 2 bodies
    at once, and the limit is used (2 side by side)."""
    from tests.apps import pools

    name, extra, env = pool_setting(pool)
    started = [
        workers.start(
            APP,
            wait=False,
            pool=name,
            concurrency=concurrency,
            queues=pools.CAPPED_QUEUE,
            extra_args=extra,
            env=env,
        )
        for _ in range(3)
    ]
    for worker in started:
        worker.wait_ready()
    total = 300
    with pools.app.producer_or_acquire() as producer:
        for _ in range(total):
            pools.capped.apply_async((0.02,), producer=producer)

    runs = observer.wait_for(total, timeout=240)

    assert len(runs) == total
    assert max_concurrent(runs) <= 2
    assert observer.max_running("capped") <= 2
    assert max_concurrent(runs) == 2
    for worker in started:
        assert "ERROR/" not in worker.log_text(), worker.log_tail()
