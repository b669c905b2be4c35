"""A store that is down, said in words an operator acts on, and not every renewal
(issue 39 §4): real worker, real CLI, the real store stopped."""

from __future__ import annotations

import re
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
    long as the store was down, from a worker holding no lease; then once, still
    naming a lease renewal where no lease was held."""
    worker = workers.start("tests.apps.exclusive", concurrency=1)
    store_server.restart(down_for=10.0)  # about four renewal intervals
    wait_until(lambda: "store answers again" in worker.log_text(), 30, "the recovery line")
    log = worker.log_text()
    down = [
        line for line in log.splitlines() if "renewal failed" in line or "store is down" in line
    ]
    assert len(down) == 1, log
    assert "connection refused" in down[0] or "Connection refused" in down[0], down
    assert "renewal" not in down[0], down  # it holds no lease


@pytest.mark.timeout(180)
def test_requests_held_for_a_store_that_is_down_are_said_once_then_counted(
    workers: Workers, store_server: StoreServer
) -> None:
    """Before: one WARNING per held request (and per retry), 56 lines for 50 tasks while
    the store was down. Now the first held request is a WARNING that says what happens,
    the others INFO, and their number is said when the store answers again."""
    from tests.apps.exclusive import ex_skip

    worker = workers.start("tests.apps.exclusive", concurrency=2)
    assert isinstance(ex_skip.delay("warm").get(timeout=60), int)  # past the store's grace
    store_server.stop()
    try:
        results = [ex_skip.delay(f"down{n}") for n in range(8)]
        wait_until(
            lambda: len(set(re.findall(r"holding \S+\[([^\]]+)\]", worker.log_text()))) >= 8,
            30,
            "every request held for the store",
        )
    finally:
        store_server.start()
    assert all(isinstance(r.get(timeout=60), int) for r in results), "a request was skipped"
    wait_until(lambda: "held for it ask again" in worker.log_text(), 30, "the count at the end")
    lines = _holding_lines(worker.log_text())
    warned = [line for line in lines if "WARNING" in line]
    assert len(warned) == 1, "\n".join(lines)
    assert "the next ones are logged at INFO" in warned[0], warned[0]
    assert all("INFO" in line for line in lines if line not in warned), "\n".join(lines)
    back = [line for line in worker.log_text().splitlines() if "held for it ask again" in line]
    assert len(back) == 1 and "WARNING" in back[0], back
    assert "8 guarded request(s)" in back[0], back[0]


def _holding_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if "store unavailable, holding" in line]
