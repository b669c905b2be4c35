"""Batching on Sentinel through a master change (issue 37: "through a store failover:
say what a batch in flight sees").

1 master, 1 replica, 3 sentinels; two workers of ``tests.apps.batching`` (2 pool
processes each) with ``BATON_URL`` = ``sentinel://...``. Calls of 4 keys stream in, 10 a
second: at any moment some wait for their batch (0.5 s), some batches run (0.8 s), some
have just been marked done and their holders not yet told. Then the master changes, by
SIGKILL (the sentinels promote the replica ~2 s later) or by ``SENTINEL FAILOVER`` (the
old master stays a writable master until the workers see the switch). The stream goes
on after the change. Judged from outside (the observer, on the broker server, records
each batch run and its call ids): every call in exactly one successful run, each caller
gets its own result, and calls published after the change run too.

Before: the planned failover ran 2-3 calls of ~75 in two successful runs. The old master
took writes until each worker process saw the switch: done markers written by pool
processes (their calls still waiting on the new master, claimed again) and claims (their
calls claimed again beside the run). Now a promoted server gives each key a grace of one
run ttl without claims, in which runners write their runs back, and a worker marks the
batches it ran to their end done again (its log counts them: 7-16 per failover here).
"""

from __future__ import annotations

import time

import pytest

from tests.batching.stream import Publisher, judge_stream
from tests.batching.test_batching import APP, runs_of
from tests.failover.test_sentinel import _wait_new_master
from tests.support.observer import Observer
from tests.support.sentinel_topology import SentinelTopology
from tests.support.workers import Workers

LEASE_TTL = 4.0


@pytest.mark.timeout(150)
@pytest.mark.parametrize("how", ["sigkill", "failover"])
def test_batches_in_flight_through_a_sentinel_failover_run_each_call_once(
    workers: Workers,
    observer: Observer,
    sentinel: SentinelTopology,
    sentinel_url: str,
    how: str,
) -> None:
    env = {"BATON_URL": sentinel_url, "BATCH_LEASE_TTL": str(LEASE_TTL)}
    pool = [workers.start(APP, concurrency=2, env=env, wait=False) for _ in range(2)]
    for worker in pool:
        worker.wait_ready()
    old = sentinel.master()
    with Publisher() as stream:
        # Batches running, others waiting, before the change.
        deadline = time.monotonic() + 30
        while len(runs_of(observer, "steady")) < 4 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)
        changed = time.monotonic()
        changed_us = observer.now_us()
        if how == "sigkill":
            old.kill()
        else:
            sentinel.failover()
        _wait_new_master(sentinel, old)
        named = time.monotonic() - changed
        named_us = observer.now_us()
        stream.mark()
        time.sleep(4.0)  # the stream goes on on the new master
    judge_stream(
        observer,
        stream,
        pool,
        label=f"SENTINEL {how}: new master named {named:.1f} s after",
        lease_ttl=LEASE_TTL,
        changed_us=changed_us,
        promoted_us=named_us,
    )
