"""An ordered call stopped mid-run, at its hard time limit or by ``revoke(terminate=
True)``, on the pools that can stop one: Celery kills its process (prefork) or greenlet
(gevent). Its turn passes at once: the next call of its key starts after the stop, not
after the gap bound (20 s) or a lease's lapse, and the stopped call never runs again.
Judged by the observer's starts (their own server's clock) and each caller's result."""

from __future__ import annotations

from typing import Any

import pytest
from celery.exceptions import TimeLimitExceeded

from tests.ordered.test_ordered import start_workers
from tests.support.observer import Observer
from tests.support.workers import Workers


def assert_the_turn_passed(observer: Observer, key: str, stopped: Any, rest: list[Any]) -> float:
    """Every call of ``key`` started once, in publish order (the stopped one first), and
    each later one got its own result; the seconds from the stopped call's start to the
    next call's."""
    assert [r.get(timeout=30) for r in rest] == list(range(1, len(rest) + 1))
    starts = sorted((s for s in observer.started() if s["key"] == key), key=lambda s: s["start"])
    assert [s["task_id"] for s in starts] == [stopped.id] + [r.id for r in rest]
    return (starts[1]["start"] - starts[0]["start"]) / 1e6


@pytest.mark.parametrize("pool", ["prefork", "gevent"])
def test_a_call_killed_at_its_time_limit_passes_its_turn_at_once(
    workers: Workers, observer: Observer, pool: str
) -> None:
    from tests.apps.ordered import ordered_apply

    start_workers(workers, 1, pool=pool)
    key = f"limit-{pool}"
    killed = ordered_apply.apply_async((key, 0, 6.0), time_limit=1)
    rest = [ordered_apply.delay(key, n) for n in range(1, 4)]

    with pytest.raises(TimeLimitExceeded):
        killed.get(timeout=30)
    # The time limit is 1 s: the next start comes after the kill, well within the gap
    # bound (20 s) and well before the killed body's own 6 s would have ended.
    assert assert_the_turn_passed(observer, key, killed, rest) < 5


@pytest.mark.parametrize("pool", ["prefork", "gevent"])
def test_a_call_revoked_mid_run_passes_its_turn_at_once(
    workers: Workers, observer: Observer, pool: str
) -> None:
    from celery.exceptions import TaskRevokedError

    from tests.apps.ordered import app, ordered_apply
    from tests.support.waiting import revoke_until_heard

    start_workers(workers, 1, pool=pool)
    key = f"revoked-{pool}"
    stopped = ordered_apply.delay(key, 0, 6.0)
    rest = [ordered_apply.delay(key, n) for n in range(1, 4)]
    observer.starts_of(key, timeout=30)
    revoke_until_heard(app, stopped.id, terminate=True)

    with pytest.raises(TaskRevokedError):
        stopped.get(timeout=30)
    assert assert_the_turn_passed(observer, key, stopped, rest) < 6  # not its body's 6 s
