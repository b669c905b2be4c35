"""A stale rate grant's fresh token is not waited for inside the task's time limits.

Issue 34 §2. A rate grant that reached its pool process late is replaced by a fresh
token before the body starts (``worker/pool/rate_grant.py``). The wait for that token
ran in ``task_prerun``, inside the task's time limits (Celery starts them when the
process accepts the job): a ``soft_time_limit`` cut it (``SoftTimeLimitExceeded``,
which Celery's signal dispatch swallows) and the body started without a token; a hard
``time_limit`` killed the process during the wait, and the message, acknowledged when
the process accepted it, was consumed without its body ever running.

Grants reach their processes late two ways here: the processes stand still when the
grants are handed to them (SIGSTOP, as a process swapped out would), and processes
replaced after every task (``--max-tasks-per-child=1``, the issue's deployment). Every
call must start exactly once, and the starts keep the rate (the observer's clock).
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter

import pytest

from tests.limits.test_rate_limits import assert_gcra_bound
from tests.support.observer import Observer
from tests.support.workers import Workers

#: Admission to the body's first line on a loaded 2-core machine (as in test_at_start).
START_JITTER_US = 250_000

KINDS = ["soft_limited", "hard_limited"]


def _assert_each_started_once_at_the_rate(observer: Observer, kind: str, ids: list[str]) -> None:
    observer.starts_of(kind, len(ids), timeout=40)
    starts = [s for s in observer.started() if s["key"] == kind]
    times = Counter(s["task_id"] for s in starts)
    assert sorted(times) == sorted(ids) and set(times.values()) == {1}, times
    assert_gcra_bound([s["start"] for s in starts], 1.0, burst=1, tolerance_us=START_JITTER_US)


@pytest.mark.parametrize("kind", KINDS)
def test_a_fresh_token_for_a_stalled_process_is_not_waited_for_inside_the_time_limit(
    workers: Workers, observer: Observer, kind: str
) -> None:
    """Three pool processes stand still while they are handed a grant each, 1 s apart;
    when they go on, all three grants are stale: the third waits ~2 s for its fresh
    token, longer than the task's 1 s limit."""
    from tests.apps import recycled

    task = getattr(recycled, kind)
    worker = workers.start("tests.apps.recycled", concurrency=3)
    children = worker.pool_pids()
    assert len(children) == 3
    for pid in children:
        os.kill(pid, signal.SIGSTOP)
    try:
        ids = [task.delay(n).id for n in range(6)]
        time.sleep(3.5)  # each stopped process is handed one grant, 1 s apart
    finally:
        for pid in children:
            os.kill(pid, signal.SIGCONT)
    _assert_each_started_once_at_the_rate(observer, kind, ids)


@pytest.mark.parametrize(
    ("kind", "autoscale"),
    [(kind, []) for kind in KINDS] + [("soft_limited", ["--autoscale=3,1"])],
    ids=[*KINDS, "soft_limited-autoscale"],
)
def test_a_recycling_pool_keeps_the_rate_and_runs_every_call_under_time_limits(
    workers: Workers, observer: Observer, kind: str, autoscale: list[str]
) -> None:
    """The issue's deployment: ``-c 3 --max-tasks-per-child=1``, 1/s, a time limit (and
    the same pool grown and shrunk by ``--autoscale``)."""
    from tests.apps import recycled

    task = getattr(recycled, kind)
    workers.start(
        "tests.apps.recycled", concurrency=3, extra_args=["--max-tasks-per-child=1", *autoscale]
    )
    ids = [task.delay(n).id for n in range(12)]
    _assert_each_started_once_at_the_rate(observer, kind, ids)


def test_a_process_killed_while_it_waits_for_a_fresh_token_loses_no_call(
    workers: Workers, observer: Observer
) -> None:
    """The wait for a fresh token comes before the process accepts the job: killed
    meanwhile (here SIGKILL; the OOM killer in a deployment), it has not accepted it,
    the message is not acknowledged, and Celery writes the job to another process."""
    from tests.apps import recycled

    worker = workers.start("tests.apps.recycled", concurrency=2)
    children = worker.pool_pids()
    assert len(children) == 2
    for pid in children:
        os.kill(pid, signal.SIGSTOP)
    try:
        ids = [recycled.rated.delay(n).id for n in range(4)]
        time.sleep(2.5)  # each stopped process is handed one grant, 1 s apart
    finally:
        for pid in children:
            os.kill(pid, signal.SIGCONT)
    # Both grants are stale now: one process takes the next token and starts, the other
    # waits a second for the one after it, and is killed meanwhile.
    first = observer.starts_of("rated", 1, timeout=20)[0]
    (waiting,) = [pid for pid in children if pid != first["pid"]]
    os.kill(waiting, signal.SIGKILL)
    _assert_each_started_once_at_the_rate(observer, "rated", ids)
