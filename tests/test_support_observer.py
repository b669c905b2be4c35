"""The observer's checkers, on hand-made runs (no server)."""

from __future__ import annotations

import pytest

from tests.support.observer import Run, assert_fences_increase, assert_no_overlap, max_concurrent


def run(key: str, start: int, end: int, fence: int | None = None, task_id: str = "") -> Run:
    return Run(key=key, fence=fence, start=start, end=end, task_id=task_id or f"t{start}")


def test_no_runs_is_fine() -> None:
    assert_no_overlap([])
    assert_fences_increase([])
    assert max_concurrent([]) == 0


def test_back_to_back_runs_do_not_overlap() -> None:
    runs = [run("a", 10, 20), run("a", 0, 10), run("a", 20, 30)]
    assert_no_overlap(runs)
    assert max_concurrent(runs) == 1


def test_overlap_names_key_and_both_tasks() -> None:
    runs = [run("a", 0, 10, task_id="first"), run("a", 9, 20, task_id="second")]
    with pytest.raises(AssertionError, match="key 'a'") as info:
        assert_no_overlap(runs)
    assert "first" in str(info.value)
    assert "second" in str(info.value)


def test_overlap_with_an_earlier_long_run_is_caught() -> None:
    # The middle run does not overlap the last one; the first (long) run does.
    runs = [run("a", 0, 100, task_id="long"), run("a", 10, 20), run("a", 50, 60, task_id="late")]
    with pytest.raises(AssertionError, match="2 overlapping") as info:
        assert_no_overlap(runs)
    assert "late" in str(info.value)


def test_runs_of_different_keys_may_overlap() -> None:
    runs = [run("a", 0, 10), run("b", 5, 15)]
    assert_no_overlap(runs)
    with pytest.raises(AssertionError, match="overlapping"):
        assert_no_overlap(runs, per_key=False)


def test_identical_intervals_overlap() -> None:
    with pytest.raises(AssertionError):
        assert_no_overlap([run("a", 5, 10), run("a", 5, 10)])


def test_max_concurrent_sweeps_half_open_intervals() -> None:
    runs = [
        run("a", 0, 10),
        run("a", 5, 15),
        run("b", 6, 8),
        run("a", 10, 12),  # starts as the first ends: not concurrent with it
        run("b", 15, 20),
    ]
    assert max_concurrent(runs) == 3
    assert max_concurrent(runs, key="a") == 2
    assert max_concurrent(runs, key="b") == 1
    assert max_concurrent(runs, key="c") == 0


def test_fences_must_strictly_increase_in_start_order() -> None:
    assert_fences_increase([run("a", 10, 20, fence=2), run("a", 0, 10, fence=1)])
    assert_fences_increase([run("a", 0, 1, fence=5), run("a", 1, 2), run("a", 2, 3, fence=6)])
    assert_fences_increase([run("a", 0, 1, fence=5), run("b", 1, 2, fence=1)])
    with pytest.raises(AssertionError, match="key 'a'"):
        assert_fences_increase([run("a", 0, 10, fence=3), run("a", 10, 20, fence=3)])
    with pytest.raises(AssertionError, match="not increasing"):
        assert_fences_increase([run("a", 0, 10, fence=4), run("a", 10, 20, fence=2)])
