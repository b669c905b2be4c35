"""The soak's ``rate-start`` and ``rate`` checks on hand-made histories: each fails on its
violation and passes on a history that keeps the promise."""

from __future__ import annotations

import itertools

from tests.soak.checks.rate import _worst_window
from tests.soak.histories import S, judge, run


def test_rate_above_rate_plus_burst_fails() -> None:
    # 4/s with burst 2: three admissions within 0.2 s is one too many.
    fences = [0, 100_000, 200_000]
    report = judge([run("rated", str(i), 0, 0, fence=f) for i, f in enumerate(fences)])
    assert report.failed_checks() == ["rate"]
    spaced = [0, 0, 250_000, 500_000, 750_000, 1_000_000]
    runs = [run("rated", str(i), f / S, f / S, fence=f) for i, f in enumerate(spaced)]
    assert judge(runs).ok


def test_starts_that_burst_fail_though_their_admissions_kept_the_rate() -> None:
    # 4/s with burst 2, admitted on schedule over 1 s while every pool process was busy
    # (80bd098): they all start within 40 ms when one process frees.
    fences = [0, 0, 250_000, 500_000, 750_000, 1_000_000]
    runs = [
        run("rated", str(i), 1.5 + i * 0.008, 1.5 + i * 0.008, fence=f, pid=7)
        for i, f in enumerate(fences)
    ]
    report = judge(runs)
    assert report.failed_checks() == ["rate-start"]
    [message] = report.violations["rate-start"]
    assert message.startswith("6 starts in [1500000, 1540000] (0.040 s): more than burst 2")
    assert "admitted over 1.000 s" in message and "pids [7]" in message
    assert report.counts["rated admission to start max ms"] == 1508


def test_starts_may_trail_their_admission_by_the_hand_over() -> None:
    # Every other run handed to the pool 0.2 s late: two starts come closer than 1/rate.
    fences = [0, 0, 250_000, 500_000, 750_000, 1_000_000, 1_250_000, 1_500_000]
    runs = [
        run("rated", str(i), f / S + (0.2 if i % 2 == 0 else 0), 2, fence=f)
        for i, f in enumerate(fences)
    ]
    assert judge(runs).ok
    # Two more starts in the first half second are a burst (7 > 2 + 4 x (0.5 + 0.25)).
    late = [
        *runs,
        *(run("rated", f"x{i}", 0.5, 2, fence=1_750_000 + i * 250_000) for i in range(2)),
    ]
    assert judge(late).failed_checks() == ["rate-start"]


def test_the_worst_window_is_the_one_a_search_of_every_pair_finds() -> None:
    import random

    rng = random.Random(5)
    for _ in range(200):
        times = sorted(rng.randrange(0, 3 * S) for _ in range(rng.randrange(1, 30)))
        rate, burst, tolerance = rng.choice([1.0, 4.0, 10.0]), rng.randrange(1, 4), 0.25
        worst = 0.0
        for i, j in itertools.combinations_with_replacement(range(len(times)), 2):
            allowed = burst + rate * ((times[j] - times[i]) / S + tolerance)
            worst = max(worst, j - i + 1 - allowed)
        found = _worst_window(times, rate, burst, tolerance)
        if worst <= 1e-9:
            assert found is None
        else:
            assert found is not None and abs(found[0] - worst) < 1e-6
            excess, n, i, j = found
            assert n == j - i + 1
            allowed = burst + rate * ((times[j] - times[i]) / S + tolerance)
            assert abs(n - allowed - excess) < 1e-6
