"""A stopped run on the green pools (``-P gevent``, ``-P eventlet``) and prefork: its key
is free only once its body really ended, judged by the observer on its server's clock.

# assumes: a run's end is seen where it happens. Prefork's ``terminate_job`` signals a
# process (a pid names a process: it is gone when the run is); gevent's kills a greenlet
# and returns before the greenlet's ``finally`` ran, and its "pid" is the greenlet's id,
# which names no process (issue 34 §3: the next run started 0.46 s before the old run's
# last write). Each stopped run here cleans up for 0.5 s in its ``finally``.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.observer import Observer
from tests.support.pools import EVENTLET
from tests.support.servers import StoreServer
from tests.support.waiting import revoke_until_heard
from tests.support.workers import Workers

APP = "tests.apps.pools"
CLEANUP = 0.5
#: The next run outlasts the stopped run's cleanup: its end is seen before the test ends.
NEXT_RUN = 3 * CLEANUP

POOLS = ["prefork", "gevent", EVENTLET]


def _starts(observer: Observer, key: str) -> list[dict[str, Any]]:
    entries = sorted((s for s in observer.started() if s["key"] == key), key=lambda s: s["start"])
    for entry in entries:
        entry["id"], n = entry["task_id"].rsplit(":", 1)
        entry["n"] = int(n)
    return entries


def assert_stopped_before_next(observer: Observer, broker_server: StoreServer, key: str) -> None:
    """The stopped run's last write (its cleanup, or its last heartbeat when it was
    killed) came before the next run of ``key`` started."""
    from tests.apps.pools import last_writes

    old, new = _starts(observer, key)[:2]
    assert (old["n"], new["n"]) == (0, 1)
    with broker_server.client(2) as client:
        last = last_writes(client, key).get(old["id"], old["start"])  # (killed at once)
    early = (last - new["start"]) / 1e6
    assert early < 0, f"run 1 started {early:.3f} s before the stopped run's last write"
    assert new["fence"] > old["fence"]


@pytest.mark.parametrize("pool", POOLS)
def test_replace_frees_the_key_once_the_replaced_body_ended(
    pool: str, workers: Workers, observer: Observer, broker_server: StoreServer
) -> None:
    from tests.apps.pools import replaced

    workers.start(APP, pool=pool, concurrency=4)
    first = replaced.delay("k", 0, 60, CLEANUP)
    observer.starts_of("k")
    newer = replaced.delay("k", 1, NEXT_RUN)

    assert newer.get(timeout=30) == 1
    observer.starts_of("k", 2)
    assert_stopped_before_next(observer, broker_server, "k")
    first.get(timeout=10, propagate=False)
    assert first.state == "REVOKED"


@pytest.mark.parametrize("pool", POOLS)
def test_revoke_terminate_frees_the_key_once_the_body_ended(
    pool: str, workers: Workers, observer: Observer, broker_server: StoreServer
) -> None:
    from tests.apps.pools import STOPPABLE_QUEUE, app, stoppable

    workers.start(APP, pool=pool, concurrency=4, queues=STOPPABLE_QUEUE)
    first = stoppable.delay("t", 0, 60, CLEANUP)
    observer.starts_of("t")
    waiting = stoppable.delay("t", 1, NEXT_RUN)
    revoke_until_heard(app, first.id, terminate=True)

    assert waiting.get(timeout=30) == 1
    observer.starts_of("t", 2)
    assert_stopped_before_next(observer, broker_server, "t")
