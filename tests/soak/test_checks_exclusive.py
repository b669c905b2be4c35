"""The soak's ``exclusive``, ``concurrency`` and ``unique`` checks on hand-made histories:
each fails on its violation and passes on a history that keeps the promise."""

from __future__ import annotations

from tests.soak.checker import Fault
from tests.soak.histories import S, judge, run


def test_exclusive_overlap_fails_and_names_both_runs() -> None:
    report = judge([run("ex_skip:a", "1", 0, 2, fence=1), run("ex_skip:a", "2", 1, 3, fence=2)])
    assert report.failed_checks() == ["exclusive"]
    assert "overlaps" in report.violations["exclusive"][0]
    assert "replay: python -m tests.soak.nemesis --seed 42" in report.summary()


def test_overlap_after_a_store_outage_longer_than_half_the_lease_is_a_known_window() -> None:
    runs = [run("ex_wait:a", "1", 0, 12, fence=1), run("ex_wait:a", "2", 9, 10, fence=2)]
    long_pause = Fault("pause_store", 1 * S, 9 * S)  # 8 s > lease_ttl 6 s / 2
    report = judge(runs, faults=[long_pause])
    assert report.ok, report.summary()
    assert len(report.known["exclusive-lease-lost"]) == 1
    assert "known window exclusive-lease-lost: 1" in report.summary()


def test_overlap_after_a_short_outage_is_a_violation() -> None:
    runs = [run("ex_wait:a", "1", 0, 12, fence=1), run("ex_wait:a", "2", 9, 10, fence=2)]
    report = judge(runs, faults=[Fault("pause_store", 1 * S, 2 * S)])
    assert report.failed_checks() == ["exclusive"]


def test_overlap_of_a_run_whose_worker_logged_the_loss_is_a_known_window() -> None:
    runs = [run("ex_wait:a", "1", 0, 12, fence=1), run("ex_wait:a", "2", 9, 10, fence=2)]
    report = judge(runs, lost_leases={"1"})
    assert report.ok and report.known["exclusive-lease-lost"], report.summary()


def test_a_lower_fence_on_the_later_run_is_never_a_known_window() -> None:
    runs = [run("ex_wait:a", "1", 0, 12, fence=2), run("ex_wait:a", "2", 9, 10, fence=1)]
    report = judge(runs, lost_leases={"1"})
    assert report.failed_checks() == ["exclusive"]


def test_one_task_id_twice_at_once_is_a_violation() -> None:
    report = judge([run("ex_wait:a", "1", 0, 2, fence=1), run("ex_wait:a", "1", 1, 3, fence=2)])
    assert "one task id twice at once" in report.violations["exclusive"][0]


def test_fences_must_grow_in_start_order() -> None:
    report = judge([run("ex_skip:a", "1", 0, 1, fence=5), run("ex_skip:a", "2", 2, 3, fence=5)])
    assert "fence not increasing" in report.violations["exclusive"][0]


def test_concurrency_above_the_cap_fails() -> None:
    runs = [run("capped", str(i), i * 0.1, 2) for i in range(3)]
    report = judge(runs)
    assert report.failed_checks() == ["concurrency"]
    assert report.counts["capped max running"] == 3


def test_unique_runs_of_two_ids_at_once_fail() -> None:
    report = judge([run("uq:a", "1", 0, 3), run("uq:a", "2", 2, 4)])
    assert report.failed_checks() == ["unique"]


def test_a_copy_of_a_run_killed_right_after_its_end_beside_a_new_id_is_a_known_window() -> None:
    """Run 1 ended at 2 s and its pool process was killed 0.17 s later, before Celery
    heard of the end: its message came back and its copy ran from 3 s, beside task 2,
    published after the end freed the key (no redelivery guard: at least once)."""
    runs = [
        run("uq:a", "1", 0, 2, pid=7),
        run("uq:a", "1", 3, 5, pid=8),
        run("uq:a", "2", 4, 6, pid=9),
    ]
    kill = [Fault("kill_child", int(2.17 * S), int(2.18 * S), pids=(7,))]
    report = judge(runs, faults=kill)
    assert report.ok, report.summary()
    assert "killed (kill_child)" in report.known["unique-copy-after-end"][0]
    # A process killed a second after the end had reported it: no excuse then.
    late = [Fault("kill_child", int(3.0 * S), int(3.01 * S), pids=(7,))]
    assert judge(runs, faults=late).failed_checks() == ["unique"]
    # Nor is another process's death.
    other = [Fault("kill_child", int(2.17 * S), int(2.18 * S), pids=(5,))]
    assert judge(runs, faults=other).failed_checks() == ["unique"]
