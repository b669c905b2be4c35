"""Operators' commands and the store-down policies on a real Redis Cluster.

``celery baton limits set/clear`` write a task's runtime overrides on the master of the
task's slot, where the workers' gate reads them. The store goes down by SIGSTOP of the
master serving a task's keys *and* its replica (nothing can be promoted; the cluster
reports ``CLUSTERDOWN`` once the master is marked failed): under ``hold`` nothing runs
until it is back, under ``run`` the tasks run unguarded and say so; the CLI says the
store is unreachable instead of failing with a traceback.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

import pytest

from tests.failover.conftest import ProdStore
from tests.failover.test_cluster import start
from tests.support.celery_processes import _process_env
from tests.support.cluster_topology import ClusterTopology
from tests.support.observer import Observer, max_concurrent
from tests.support.processes import REPO_ROOT
from tests.support.waiting import wait_until
from tests.support.workers import Workers


@pytest.fixture
def prod_store(cluster: ClusterTopology, cluster_url: str) -> ProdStore:
    return ProdStore("cluster", cluster_url, cluster)


def baton(
    workers: Workers, app: str, *args: str, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", app, "baton", *args],
        env=_process_env(workers.env),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def as_json(workers: Workers, app: str, *args: str) -> Any:
    done = baton(workers, app, *args, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.timeout(180)  # five commands, each starting Celery: seconds apiece when loaded
def test_limits_set_on_the_cluster_reaches_every_worker(
    prod_workers: Workers, observer: Observer
) -> None:
    from tests.apps.limits import capped

    app = "tests.apps.limits"
    start(prod_workers, app, n=2, concurrency=3)
    as_json(prod_workers, app, "limits", "set", capped.name, "--concurrency", "1")
    listing = as_json(prod_workers, app, "limits")
    row = next(t for t in listing["tasks"] if t["task"] == capped.name)
    assert row["overrides"] == {"concurrency": "1"}
    for _ in range(6):
        capped.delay(0.3)
    runs = observer.wait_for(6, timeout=30)
    assert max_concurrent(runs) == 1  # declared 2; the override says 1

    as_json(prod_workers, app, "limits", "clear", capped.name)
    listing = as_json(prod_workers, app, "limits")
    assert next(t for t in listing["tasks"] if t["task"] == capped.name)["overrides"] == {}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("policy", ["hold", "run"])
def test_store_down_on_the_cluster(
    prod_workers: Workers, observer: Observer, cluster: ClusterTopology, policy: str
) -> None:
    from tests.apps.exclusive import ex_unfenced, exclusive_key

    app = "tests.apps.exclusive"
    worker = prod_workers.start(app, concurrency=3, env={"BATON_TEST_ON_STORE_ERROR": policy})
    assert ex_unfenced.delay("warm").get(timeout=30)  # connected to every master
    # One family: every key of the task is on this master's slot.
    master = cluster.master_of(exclusive_key(ex_unfenced, "outage-0"))
    replica = cluster.replica_of(master)
    replica.pause()
    master.pause()
    try:
        results = [ex_unfenced.delay(f"outage-{i}") for i in range(3)]
        if policy == "hold":
            wait_until(
                lambda: "store unavailable, holding" in worker.log_text(),
                30,
                "the worker holds the requests",
            )
            time.sleep(1.0)  # not a wait: a request let through would start meanwhile
            assert [s for s in observer.started() if s["key"].startswith("outage")] == []
            assert all(result.state == "PENDING" for result in results)
        else:
            for result in results:
                assert result.get(timeout=60)
            assert worker.log_text().count("UNGUARDED") >= 3
        status = baton(prod_workers, app, "status", timeout=90)
        assert status.returncode != 0 and "Traceback" not in status.stderr, status.stderr
        assert "store" in status.stderr.lower(), status.stderr
    finally:
        master.resume()
        replica.resume()
    for result in results:
        assert result.get(timeout=60)  # held ones run once the store is back
    runs = [r for r in observer.runs() if r.key.startswith("outage")]
    assert len(runs) == 3
    assert worker.is_running
    assert "Traceback" not in worker.log_text()
