"""Rough edges of the operator CLI found in a user audit, run as real commands against
real servers and workers: ``limits set --rate`` without ``--burst`` keeps the declared
burst; ``end-grace`` checks the grace and the live workers; a task name typed wrong in
``limits set`` gets the names near it; tables are cut only on a terminal; a redbeat URL
that cannot be read is named."""

from __future__ import annotations

import pytest

from tests.ops.test_commands import as_json, baton
from tests.support.observer import Observer
from tests.support.workers import Workers

LIMITS = "tests.apps.limits"


@pytest.mark.timeout(180)
def test_limits_set_rate_without_burst_keeps_the_declared_burst(
    workers: Workers, observer: Observer
) -> None:
    """Before: ``limits set`` on a task declared ``10/s`` burst 5 with ``--rate`` alone
    stored burst 1 (``rate 5/s burst 1``), and the workers enforced burst 1."""
    from tests.apps import limits
    from tests.limits.test_rate_limits import admissions, assert_gcra_bound, publish, start_workers

    name = limits.bursty.name
    done = baton(workers, "limits", "set", name, "--rate", "5/s", app=LIMITS)
    assert done.returncode == 0, done.stderr
    after = {t["task"]: t for t in as_json(workers, "limits", app=LIMITS)["tasks"]}
    assert after[name]["overrides"] == {"rate": "200000 5"}, after[name]
    assert "rate 5/s burst 5" in baton(workers, "limits", app=LIMITS).stdout

    # Enforced as shown: the workers read the override's burst (gate "O", then "R").
    start_workers(workers, 2)
    publish(limits.bursty, 12, numbered=True)
    admitted = sorted(admissions(observer.wait_for(12, timeout=60)))
    assert_gcra_bound(admitted, 5, burst=5)
    # Burst 1 at 5/s puts 200 ms between each two starts: 800 ms from the first to the
    # fifth. The burst lets the first five start back to back.
    assert admitted[4] - admitted[0] < 4 * 200_000, [a - admitted[0] for a in admitted[:6]]
    # And the rate is the override's, not the declared 10/s: 12 starts, 5 of them the
    # burst, take at least 7 intervals of 200 ms.
    assert admitted[-1] - admitted[0] >= 7 * 200_000 - 1
