"""A store that is down, said in words an operator acts on, and not every renewal
(issue 39 §4): real worker, real CLI, the real store stopped."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from tests.support.celery_processes import _process_env
from tests.support.processes import REPO_ROOT
from tests.support.servers import StoreServer
from tests.support.waiting import wait_until
from tests.support.workers import Workers


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_cli_says_connection_refused_at_host_port(workers: Workers) -> None:
    """Before: ``store call failed: network:ConnectionError (store redis://...)``."""
    port = _closed_port()
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.apps.exclusive", "baton", "status"],
        env=_process_env({**workers.env, "BATON_URL": f"redis://127.0.0.1:{port}/0"}),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert f"connection refused at 127.0.0.1:{port}" in done.stderr, done.stderr
    assert "baton_url" in done.stderr and "network:" not in done.stderr, done.stderr


def test_the_cli_says_an_unknown_host_is_unknown(workers: Workers) -> None:
    """Before: ``ConnectionError: Error -2 connecting to nosuchhost.invalid:6379. Name or
    service not known.``, with no word of the setting to fix."""
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.apps.exclusive", "baton", "status"],
        env=_process_env({**workers.env, "BATON_URL": "redis://nosuchhost.invalid:6379/0"}),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "unknown host in nosuchhost.invalid:6379" in done.stderr, done.stderr
    assert "check baton_url" in done.stderr, done.stderr


@pytest.mark.timeout(120)
def test_a_worker_says_the_store_is_down_once_not_every_renewal(
    workers: Workers, store_server: StoreServer
) -> None:
    """Before: ``lease renewal failed`` every lease_ttl / 3 (2.7 s by default) for as
    long as the store was down, from a worker holding no lease."""
    worker = workers.start("tests.apps.exclusive", concurrency=1)
    store_server.restart(down_for=10.0)  # about four renewal intervals
    wait_until(lambda: "store answers again" in worker.log_text(), 30, "the recovery line")
    log = worker.log_text()
    down = [
        line for line in log.splitlines() if "renewal failed" in line or "store is down" in line
    ]
    assert len(down) == 1, log
    assert "connection refused" in down[0] or "Connection refused" in down[0], down
