"""A Redis Sentinel *broker* that fails over while a worker drains guarded calls:
kombu finds the new master through the sentinels; the worker's own broker writes
(records and acks, sent on its own connection) must follow it too. Judged from
outside: no call runs twice (the redelivery guard), every call published after the
failover runs, and the new master holds no message unacknowledged once the drain is
over (the acks reached it)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import kombu.exceptions
import pytest

from tests.failover.test_sentinel import _wait_new_master
from tests.support.observer import Observer
from tests.support.sentinel_topology import SERVICE, SentinelTopology
from tests.support.waiting import wait_until
from tests.support.workers import Workers

BEFORE, AFTER = 60, 30
DB = 5  # the topology's data servers serve other tests' stores on db 0


@pytest.fixture
def sentinel_broker(
    sentinel: SentinelTopology, app_environ: None, monkeypatch: pytest.MonkeyPatch
) -> Iterator[dict[str, str]]:
    """kombu's URL of the Sentinel service as a broker (set in this process too)."""
    sentinel.wait_healthy()
    sentinel.flushall()
    # The db on every URL: kombu takes each as a whole when it fails over to it (a db on
    # the last one alone leaves the others on db 0, and a publisher and a worker that
    # failed over to different ones on different dbs).
    urls = ";".join(f"sentinel://127.0.0.1:{s.port}/{DB}" for s in sentinel.sentinels)
    env = {"TEST_SENTINEL_BROKER_URL": urls, "TEST_SENTINEL_SERVICE": SERVICE}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    yield env
    sentinel.wait_healthy()


def _published_once_a_master_answers(app: Any, key: str) -> Any:
    """The call published once the sentinels the publisher asks name the new master:
    one sentinel may name it while the one asked still answers "no master" (a CI
    rehearsal, 2026-12-01). The switch is the test's action, not what it judges; a
    publish that raised sent nothing."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return app.guarded.delay(key, 0.0)
        except kombu.exceptions.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["failover", "sigkill"])
def test_guarded_calls_run_once_across_a_failover_of_the_broker(
    workers: Workers,
    observer: Observer,
    sentinel: SentinelTopology,
    sentinel_broker: dict[str, str],
    how: str,
) -> None:
    """``failover``: planned (``SENTINEL FAILOVER``). ``sigkill``: the master is killed
    mid-drain; what it had not passed to its replica is the broker's loss (calls
    published before may not run), but an ack it took with it leaves the message
    unacknowledged on the new master, which kombu gives back after the visibility
    timeout: a copy of a call that ran, which the guard must refuse."""
    from tests.apps import sentinel_broker as app

    workers.start("tests.apps.sentinel_broker", concurrency=2, env=sentinel_broker)
    before = [app.guarded.delay(f"b{n}", 0.05) for n in range(BEFORE)]
    wait_until(lambda: len(observer.started()) >= BEFORE // 3, 60, "the drain to start")
    if how == "failover":
        sentinel.failover()
    else:
        old = sentinel.master()
        old.kill()
        _wait_new_master(sentinel, old, timeout=60)
    after = {f"a{n}": _published_once_a_master_answers(app, f"a{n}") for n in range(AFTER)}
    for key, result in after.items():
        assert result.get(timeout=90) == key
    wait_until(
        lambda: sum(1 for r in observer.runs() if r.key.startswith("a")) >= AFTER,
        60,
        "every call published after the failover to run",
    )
    with sentinel.master().client(DB) as master:
        # Given back after the visibility timeout (20 s), then refused or run.
        wait_until(
            lambda: master.hlen("unacked") == 0,
            90,
            "no message left unacknowledged on the new master",
        )
    time.sleep(2.0)  # a copy of a call that ran, were it run again, would start now
    runs = Counter(r.key for r in observer.runs())
    twice = {key: n for key, n in runs.items() if n > 1}
    assert not twice, f"ran more than once: {twice}"
    ran_before = sum(1 for key in runs if key.startswith("b"))
    print(f"calls published before the failover that ran: {ran_before} of {len(before)}")
