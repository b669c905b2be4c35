"""The soak's ``guard`` and ``beat`` checks on hand-made histories: each fails on its
violation and passes on a history that keeps the promise."""

from __future__ import annotations

from tests.soak.checker import Fault
from tests.soak.histories import S, judge, run


def test_a_guarded_id_that_finished_twice_fails() -> None:
    report = judge([run("guarded:1", "1", 0, 1), run("guarded:1", "1", 2, 3)])
    assert report.failed_checks() == ["guard"]


def test_a_guarded_id_rerun_after_its_first_run_was_killed_passes() -> None:
    runs = [run("guarded:1", "1", 0, None, pid=9), run("guarded:1", "1", 2, 3)]
    report = judge(runs, faults=[Fault("kill_worker", 1 * S, 1 * S, pids=(9,))])
    assert report.ok, report.summary()


def test_a_beat_slot_run_twice_fails() -> None:
    report = judge([run("beat:every1|1000", "b", 1, 2), run("beat:every1|1000", "b", 3, 4)])
    assert report.failed_checks() == ["beat"]


def test_beat_ticks_closer_than_the_period_fail() -> None:
    # Two leaders, each firing every second on a grid of its own.
    slots = [1000, 1064, 2000, 2064]
    report = judge([run(f"beat:every1|{s}", f"b{s}", s / 1000, s / 1000 + 0.1) for s in slots])
    assert "closer than its period" in report.violations["beat"][0]


def test_a_run_whose_worker_was_killed_as_it_ended_may_run_again() -> None:
    """Its pool process records a guarded run's (a beat slot's) end right after the body;
    a worker killed in that moment takes the record with it (20-minute soak, seed 1105: a
    beat tick ran in the pool 1 ms after kill_worker had SIGKILLed the main process, and
    its copy ran 30 s later). The known window ``run-end-unrecorded``; a death a second
    after the end, or another worker's, is still a violation."""
    for key in ("guarded:1", "beat:every1|1000"):
        twice = [run(key, "1", 0, 1.001, pid=7), run(key, "1", 30, 30.001, pid=8)]
        kill = [Fault("kill_worker", int(0.9995 * S), int(1.03 * S), pids=(5, 7))]
        report = judge(twice, faults=kill)
        assert report.ok and report.known["run-end-unrecorded"], report.summary()
        later = [Fault("kill_worker", int(2 * S), int(2.03 * S), pids=(5, 7))]
        other = [Fault("kill_worker", int(0.9995 * S), int(1.03 * S), pids=(6, 9))]
        for faults in (later, other, []):
            assert not judge(twice, faults=faults).ok, faults
    # Three runs: the second's end was recorded, so the third is a violation.
    thrice = [
        run("guarded:1", "1", 0, 1.001, pid=7),
        run("guarded:1", "1", 30, 30.001, pid=8),
        run("guarded:1", "1", 60, 60.001, pid=8),
    ]
    kill = [Fault("kill_worker", int(0.9995 * S), int(1.03 * S), pids=(5, 7))]
    assert judge(thrice, faults=kill).failed_checks() == ["guard"]
