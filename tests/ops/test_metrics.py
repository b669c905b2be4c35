"""Prometheus metrics served by a real worker: admissions, skips and holds are counted."""

from __future__ import annotations

import re
import socket
import time
import urllib.request
from pathlib import Path

import pytest

from tests.support.observer import Observer
from tests.support.servers import free_port
from tests.support.workers import Workers

APP = "tests.apps.exclusive"


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("baton_") and " " in line:
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def value(values: dict[str, float], name: str, **labels: str) -> float:
    """The sample of ``name`` whose labels include ``labels`` (in any order)."""
    for sample, number in values.items():
        base, _, rest = sample.partition("{")
        if base == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
            return number
    raise AssertionError(f"no sample {name}{labels} in {sorted(values)}")


def test_worker_serves_counters(workers: Workers, observer: Observer) -> None:
    from tests.apps.exclusive import ex_skip, ex_wait

    port = free_port()
    # Three processes: the skipped duplicate's verdict needs a free one while the first
    # run and a waiting run hold two (a held delivery asks again only when a process
    # could start it).
    workers.start(APP, concurrency=3, env={"BATON_TEST_METRICS_PORT": str(port)})
    first = ex_skip.delay("metrics", 4.0)  # the duplicate arrives while it runs, loaded
    # 20 s: a store this worker finds new holds the first lease for its grace (8 s).
    observer.starts_of("metrics", 1, timeout=20)  # it holds the key: the duplicate skips
    duplicate = ex_skip.delay("metrics", 0)
    # Long enough that the second is received while the first runs, on a loaded machine.
    waiting = [ex_wait.delay("mwait", 2.0) for _ in range(2)]
    assert first.get(timeout=20) and all(r.get(timeout=20) for r in waiting)
    duplicate.get(timeout=20, propagate=False)

    values = scrape(port)
    skip, wait = "tests.apps.exclusive.ex_skip", "tests.apps.exclusive.ex_wait"
    assert value(values, "baton_admissions_total", task=skip) == 1
    assert value(values, "baton_skips_total", task=skip, reason="exclusive") == 1
    assert value(values, "baton_admissions_total", task=wait) == 2
    assert value(values, "baton_holds_total", task=wait) >= 1
    assert value(values, "baton_held_requests") == 0


def free_range(size: int) -> tuple[int, int]:
    """``size`` consecutive ports nothing listens on right now."""
    for _ in range(50):
        base = free_port()
        if base + size > 65535:
            continue
        try:
            for port in range(base, base + size):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                    sock.bind(("0.0.0.0", port))
        except OSError:
            continue
        return base, base + size - 1
    raise AssertionError("no free port range")


def test_two_workers_on_one_host_share_a_port_range_and_the_web_view_scrapes_both(
    workers: Workers, tmp_path: Path
) -> None:
    """Two workers given one range each take a free port of it (one port for both used to
    fail with `Address already in use`); the web view's /metrics covers both from the
    store."""
    from tests.apps.exclusive import ex_skip
    from tests.ops.web_process import Web

    low, high = free_range(5)
    env = {"BATON_TEST_METRICS_PORT": f"{low}-{high}"}
    first = workers.start(APP, concurrency=1, env=env)
    second = workers.start(APP, concurrency=1, env=env)
    assert ex_skip.delay("range", 0).get(timeout=20)

    served = {}
    for port in range(low, high + 1):
        try:
            served[port] = scrape(port)
        except OSError:
            continue
    assert len(served) == 2, (sorted(served), first.log_tail(), second.log_tail())
    for values in served.values():
        assert "baton_held_requests" in values
    admitted = sum(
        v
        for values in served.values()
        for k, v in values.items()
        if k.startswith("baton_admissions_total")
    )
    assert admitted == 1
    logged = [
        int(m.group(1))
        for w in (first, second)
        for m in [re.search(r"serving Prometheus metrics on port (\d+)", w.log_text())]
        if m
    ]
    assert sorted(logged) == sorted(served), logged

    web = Web(workers, APP, None, tmp_path / "web.log")

    def admitted(text: str) -> list[float]:
        return sorted(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("baton_worker_admitted_total{")
        )

    try:
        # Workers report on their renewal tick: the admission shows up within one.
        deadline = time.monotonic() + 30
        text = web.get("/metrics")
        while admitted(text) != [0, 1] and time.monotonic() < deadline:
            time.sleep(0.5)
            text = web.get("/metrics")
    finally:
        web.stop()
    for worker in (first, second):
        assert f'baton_worker_up{{worker="{worker.hostname}"}} 1' in text, text
    assert admitted(text) == [0, 1], text


def test_metrics_port_is_a_port_or_a_range() -> None:
    from celery_baton.errors import ConfigError
    from celery_baton.metrics import parse_ports

    assert parse_ports(9100) == range(9100, 9101)
    assert parse_ports("9100-9119") == range(9100, 9120)
    for bad in ("9100-", "http", "9119-9100", "0-5", "70000"):
        with pytest.raises(ConfigError, match="baton_metrics_port"):
            parse_ports(bad)
