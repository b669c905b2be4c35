"""A run's end is recorded in the store once, by the process that ran it, on every pool.

The process that ran the body records the end (its leases freed, before its result:
worker/pool/run_end.py) and says so in memory the worker's processes share
(core/shared_ends.py); the worker's main process, which used to record the same end
again when it heard of it, now does so only when that record is missing: one store call
less per guarded run (issue 36). What this assumes of each pool: a prefork pool process
is forked from the main process after the table exists (recycled ones too:
``--max-tasks-per-child``); threads, gevent, eventlet and solo run the body in the main
process itself. Counted from outside: the store's ``release`` script calls
(``MONITOR``), one per run, where there were two.
"""

from __future__ import annotations

import pytest

from celery_baton.store.scripts import script_sha
from tests.support.monitor import monitored
from tests.support.observer import Observer
from tests.support.pools import POOLS_AND_RECYCLED
from tests.support.servers import StoreServer
from tests.support.workers import Workers

APP = "tests.apps.exclusive"
RUNS = 12


@pytest.mark.parametrize("pool", POOLS_AND_RECYCLED)
def test_each_run_end_is_recorded_once(
    workers: Workers, observer: Observer, store_server: StoreServer, pool: str
) -> None:
    from tests.apps.exclusive import ex_skip

    name, *extra = pool.split()
    workers.start(APP, pool=name, concurrency=2, extra_args=extra)
    assert ex_skip.delay("warm-up", 0).get(timeout=30)  # the scripts loaded, the pool up
    with monitored(store_server) as commands:
        for n in range(RUNS):  # one at a time: nothing asked ahead, nothing given back
            assert ex_skip.delay(f"once-{n}", 0).get(timeout=30)
        observer.wait_for(RUNS + 1, timeout=30)
    sha = script_sha("release")
    calls = [c["command"] for c in commands if c["command"].startswith(f"EVALSHA {sha}")]
    assert len(calls) == RUNS, f"{len(calls)} release calls for {RUNS} runs: {calls[:4]}"
