"""Prometheus metrics served by a real worker: admissions, skips and holds are counted."""

from __future__ import annotations

import time
import urllib.request

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


def test_worker_serves_counters(workers: Workers) -> None:
    from tests.apps.exclusive import ex_skip, ex_wait

    port = free_port()
    workers.start(APP, concurrency=2, env={"BATON_TEST_METRICS_PORT": str(port)})
    first = ex_skip.delay("metrics", 1.5)
    time.sleep(0.3)
    duplicate = ex_skip.delay("metrics", 0)
    waiting = [ex_wait.delay("mwait", 0.3) for _ in range(2)]
    assert first.get(timeout=20) and all(r.get(timeout=20) for r in waiting)
    duplicate.get(timeout=20, propagate=False)

    values = scrape(port)
    skip, wait = "tests.apps.exclusive.ex_skip", "tests.apps.exclusive.ex_wait"
    assert value(values, "baton_admissions_total", task=skip) == 1
    assert value(values, "baton_skips_total", task=skip, reason="exclusive") == 1
    assert value(values, "baton_admissions_total", task=wait) == 2
    assert value(values, "baton_holds_total", task=wait) >= 1
    assert value(values, "baton_held_requests") == 0
