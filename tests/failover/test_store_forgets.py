"""Safe when the store forgets (issue 14 §3).

A store that restarts empty (no persistence), or a failover to a replica that was
behind, loses every lease. Before: a new arrival for a key whose holder still ran was
granted at once, beside it (4 overlaps for 4 keys). Now the gate sees the store-wide
epoch missing and grants no new lease until the server's start + one lease ttl (from
now after a promotion), while live holders write theirs back at their next renewal;
the arrivals wait (nothing lost) and run after the holders, with higher fences.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from tests.support.celery_processes import _process_env
from tests.support.observer import Observer, assert_fences_increase, assert_no_overlap
from tests.support.processes import REPO_ROOT
from tests.support.servers import StoreServer
from tests.support.status_watch import status_watch
from tests.support.waiting import wait_until
from tests.support.workers import Workers

APP = "tests.apps.exclusive"
KEYS = [f"forgotten-{n}" for n in range(4)]


@pytest.fixture
def forgetful() -> Iterator[StoreServer]:
    server = StoreServer(name="forgetful", persistent=False)
    server.start()
    server.flushall()  # known new: no grace at the first lease
    yield server
    server.close()


def test_new_arrivals_wait_while_live_holders_write_their_leases_back(
    workers: Workers, observer: Observer, forgetful: StoreServer
) -> None:
    from tests.apps.exclusive import ex_long

    # lease_ttl 9 s: holders renew every 3 s, so arrivals right after the restart come
    # before the holders' next renewal (as in production, with 10 s and 3.3 s).
    worker = workers.start(
        APP,
        concurrency=8,  # a free pool slot for every arrival: admission alone decides
        env={"BATON_URL": forgetful.url(0), "BATON_TEST_LEASE_TTL": "9"},
    )
    with status_watch(APP, {**workers.env, "BATON_URL": forgetful.url(0)}) as graces:
        holders = [ex_long.delay(key, 6.0) for key in KEYS]
        wait_until(lambda: len(observer.started()) == len(KEYS), 30, "the 4 holders started")

        forgetful.restart(kill=True, down_for=1.0)  # back empty: every lease forgotten
        arrivals = [ex_long.delay(key, 0.2) for key in KEYS]
        wait_until(lambda: "lost its data" in graces(), 20, "grace in status")

    for result in holders + arrivals:
        assert result.get(timeout=60) is not None  # nothing lost
    runs = observer.runs()
    assert len(runs) == 2 * len(KEYS), runs
    assert_no_overlap(runs)
    assert_fences_increase(runs)
    log = worker.log_text()
    assert "the store is new or lost its data" in log
    assert "lease re-asserted after the store lost it" in log  # holders wrote theirs back


def test_a_known_new_store_grants_at_once(
    workers: Workers, observer: Observer, forgetful: StoreServer
) -> None:
    """The grace is for a store that lost its data, not for one declared new."""
    from tests.apps.exclusive import ex_long

    workers.start(APP, concurrency=2, env={"BATON_URL": forgetful.url(0)})
    began = time.monotonic()
    assert ex_long.delay("fresh", 0).get(timeout=30) is not None
    assert time.monotonic() - began < 30
    assert "lost its data" not in "".join(w.log_text() for w in workers.started)


def test_an_operator_ends_the_grace_of_a_store_emptied_with_no_worker_running(
    workers: Workers, observer: Observer, forgetful: StoreServer
) -> None:
    from tests.apps.first_run import guarded

    # FLUSHALL of a store that started moments ago, as in development: with lease_ttl
    # 60 s the next lease would wait until the store's start + 60 s.
    forgetful.forget()
    env = {"BATON_URL": forgetful.url(0), "FIRST_RUN_LEASE_TTL": "60"}
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.apps.first_run", "baton", "end-grace"],
        # The workers' lease_ttl, as an operator's command reads it: the grace it ends.
        env=_process_env({**workers.env, **env}),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "grace ended" in done.stdout, done.stdout
    workers.start("tests.apps.first_run", concurrency=2, env=env)
    began = time.monotonic()
    assert guarded.delay("after-end-grace", 0).get(timeout=60) is not None
    assert time.monotonic() - began < 25  # no grace waited
