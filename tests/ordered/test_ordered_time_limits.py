"""An ordered call stopped mid-run, at its hard time limit or by ``revoke(terminate=
True)``, on the pools that can stop one: Celery kills its process (prefork) or greenlet
(gevent). Its turn passes at once: the next call of its key starts after the stop, not
after the gap bound (20 s) or a lease's lapse, and the stopped call never runs again.
Judged by the observer's starts (their own server's clock) and each caller's result."""

from __future__ import annotations

import pytest
from celery.exceptions import TaskRevokedError, TimeLimitExceeded

from tests.ordered.test_ordered import start_workers
from tests.support.observer import Observer
from tests.support.pools import TIME_LIMIT_POOLS, pool_label, pool_setting
from tests.support.workers import Workers

#: How the first call is stopped: the error its caller gets, and the most seconds from
#: its start to the next call's (its body runs 6 s; the time limit is 1 s).
STOPS = {"time-limit": (TimeLimitExceeded, 5.0), "revoke": (TaskRevokedError, 6.0)}


@pytest.mark.parametrize("stop", list(STOPS))
@pytest.mark.parametrize("pool", TIME_LIMIT_POOLS)
def test_a_call_stopped_mid_run_passes_its_turn_at_once(
    workers: Workers, observer: Observer, pool: str, stop: str
) -> None:
    """Also on a prefork pool whose processes are recycled after every call (each next
    call of the key waits for a process forked after the last one left) or autoscaled
    (idle processes terminated between the calls)."""
    from tests.apps.ordered import app, ordered_apply
    from tests.support.waiting import revoke_until_heard

    error, bound = STOPS[stop]
    name, extra, env = pool_setting(pool)
    start_workers(workers, 1, pool=name, extra_args=extra, env=env)
    key = f"{stop}-{pool_label(pool)}"
    time_limit = 1 if stop == "time-limit" else None
    stopped = ordered_apply.apply_async((key, 0, 6.0), time_limit=time_limit)
    rest = [ordered_apply.delay(key, n) for n in range(1, 4)]
    if stop == "revoke":
        observer.starts_of(key, timeout=30)
        revoke_until_heard(app, stopped.id, terminate=True)

    with pytest.raises(error):
        stopped.get(timeout=30)
    assert [r.get(timeout=30) for r in rest] == [1, 2, 3]
    starts = sorted((s for s in observer.started() if s["key"] == key), key=lambda s: s["start"])
    assert [s["task_id"] for s in starts] == [stopped.id] + [r.id for r in rest]
    # Well within the gap bound (20 s), and before the stopped body's own 6 s ended.
    assert (starts[1]["start"] - starts[0]["start"]) / 1e6 < bound
