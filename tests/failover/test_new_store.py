"""A store the workers have not seen before, as a new user meets it (issue 24 §2).

Every store here is a ``redis-server`` started by the test and never declared new
(no ``flushall()``, no ``end-grace``); the app is ``tests.apps.first_run``: every
default. A lease from before a restart cannot outlive the server's start +
``lease_ttl``, so the grace a store without the store-wide epoch gets ends there, and a
store up longer than that needs none. Before: the grace ran one ``lease_ttl`` (30 s)
from the first gate call, whenever the server started -- the first guarded run of a
new user came 30 s late, and a beat's held slots then all ran in the same second.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from celery_baton.config import Settings
from tests.support.celery_processes import _process_env
from tests.support.observer import Observer
from tests.support.processes import REPO_ROOT
from tests.support.servers import StoreServer
from tests.support.waiting import wait_until
from tests.support.workers import Workers

APP = "tests.apps.first_run"


def _uptime(server: StoreServer) -> int:
    with server.client() as r:
        return int(r.info("server")["uptime_in_seconds"])


@pytest.fixture
def fresh() -> Iterator[tuple[StoreServer, float]]:
    """A new ``redis-server`` (no persistence) and the moment it was started."""
    server = StoreServer(name="fresh", persistent=False)
    began = time.time()
    server.start()
    yield server, began
    server.close()


def _first_start(observer: Observer, key: str) -> float:
    """The observer's start of ``key``'s first run, in seconds since the epoch."""
    return min(s["start"] for s in observer.starts_of(key, timeout=60)) / 1e6


@pytest.mark.timeout(120)
def test_the_first_guarded_run_comes_within_lease_ttl_of_the_stores_start(
    workers: Workers, observer: Observer, fresh: tuple[StoreServer, float]
) -> None:
    from tests.apps.first_run import guarded

    server, began = fresh
    for _ in range(2):
        workers.start(APP, env={"BATON_URL": server.url(0)}, wait=False)
    result = guarded.delay("first", 0)
    assert result.get(timeout=90) is not None
    after = _first_start(observer, "first") - began
    print(f"\nFIRST RUN: the first guarded run started {after:.1f} s after the store started")
    # No sooner than lease_ttl after the start (``began`` is before it): a lease granted
    # just before a restart may live that long (the grace read the server's uptime, in
    # whole seconds, as if it were exact: 7.6 s with an 8 s lease_ttl). No later than a
    # few seconds after it; before: one lease_ttl from the first gate call, 30 s after the
    # workers were up.
    assert after >= Settings().lease_ttl, f"granted {after:.1f} s after the store started"
    assert after < 20, f"the first guarded run came {after:.1f} s after the store started"


@pytest.mark.timeout(120)
def test_a_store_up_longer_than_lease_ttl_grants_at_once(
    workers: Workers, observer: Observer, fresh: tuple[StoreServer, float]
) -> None:
    """Up longer than lease_ttl (8 s), never used by celery-baton: nothing a restart
    lost can be live in it."""
    from tests.apps.first_run import guarded

    server, _ = fresh
    workers.start(APP, env={"BATON_URL": server.url(0)}, concurrency=2)
    wait_until(lambda: _uptime(server) >= 12, 30, "the store up 12 s")
    published = time.time()
    assert guarded.delay("idle-store", 0).get(timeout=60) is not None
    waited = _first_start(observer, "idle-store") - published
    print(f"\nIDLE STORE: the first guarded run started {waited:.2f} s after its publish")
    assert waited < 5, f"waited {waited:.1f} s on a store up {_uptime(server)} s"
    assert "lost its data" not in "".join(w.log_text() for w in workers.started)


@pytest.mark.timeout(150)
def test_beat_slots_held_past_their_misfire_grace_follow_the_misfire_policy(
    workers: Workers, observer: Observer, fresh: tuple[StoreServer, float]
) -> None:
    """A 1 s entry whose slots the worker holds (the new store's grace, here up to its
    start + 20 s): a held slot admitted when the entry's next slot is due is coalesced
    into it, one older than its misfire grace (2 s) is skipped (``baton_misfire="skip"``),
    each logged; no burst of stale ticks."""
    server, _ = fresh
    entries = {"every1": {"every": 1, "options": {"baton_misfire_grace": 2}}}
    env = {
        "BATON_URL": server.url(0),
        "FIRST_RUN_LEASE_TTL": "20",  # a hold long enough to see a burst
        "FIRST_RUN_BEAT": json.dumps(entries),
    }
    worker = workers.start(APP, env=env, concurrency=2, wait=False)
    workers.start_beat(APP, env=env)
    worker.wait_ready()

    def starts() -> list[int]:
        return sorted(s["start"] for s in observer.started() if s["key"].startswith("every1|"))

    wait_until(lambda: len(starts()) >= 8, 90, "8 ticks ran")
    time.sleep(2)  # not a wait: more ticks sent together would start meanwhile
    ticks = starts()
    most = max(sum(1 for t in ticks if t0 <= t < t0 + 1_000_000) for t0 in ticks)
    print(f"\nBEAT AFTER A HOLD: {len(ticks)} ticks, at most {most} within one second")
    # The slots still within their 2 s grace run together, and the next one may follow
    # within the same second: 4 at most.
    assert most <= 4, f"{most} ticks within one second (a 1 s entry)"
    log = worker.log_text()
    assert "coalesced into the later slot" in log or "past its misfire grace" in log, log[-2000:]


def _status(workers: Workers, server: StoreServer) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", APP, "baton", "status", "--json"],
        env=_process_env({**workers.env, "BATON_URL": server.url(0)}),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


def test_a_store_that_may_evict_keys_is_warned_about(workers: Workers, observer: Observer) -> None:
    server = StoreServer(
        name="evicting", persistent=False, extra_args=["--maxmemory-policy", "allkeys-lru"]
    )
    server.start()
    try:
        worker = workers.start(APP, env={"BATON_URL": server.url(0)}, concurrency=1)
        wait_until(lambda: "maxmemory-policy" in worker.log_text(), 10, "the warning logged")
        assert "allkeys-lru" in worker.log_text()
        status = _status(workers, server)
        assert "allkeys-lru" in str(status.get("warnings")), status
    finally:
        server.close()
