"""The soak's checker on hand-made histories: each check fails on its violation and passes
on a history that keeps the promise (times in seconds here, microseconds in the history).

Here the checker as a whole: a clean history, the runs of killed and crashed workers, the
summary and the counts; each group of checks has a file of its own (``test_checks_*``)."""

from __future__ import annotations

from tests.soak.checker import Fault, Limits
from tests.soak.histories import S, into, judge, run, sent


def test_a_clean_history_passes() -> None:
    report = judge(
        [
            run("ex_skip:a", "1", 0, 1, fence=10),
            run("ex_skip:a", "2", 1, 2, fence=11),  # starts as the first ends: half-open
            run("ex_wait:a", "3", 0.5, 1.5, fence=5),
            run("capped", "4", 0, 3),
            run("capped", "5", 0, 1),
            run("capped", "6", 1, 2),
            run("rated", "7", 0, 0, fence=0),
            run("rated", "8", 0, 0, fence=1),  # burst 2: two at once
            run("rated", "9", 0, 0, fence=250_000),  # 4/s: one more after 0.25 s
            run("uq:a", "10", 0, 1),
            run("uq:a", "11", 1, 2),
            run("guarded:12", "12", 0, 1),
            run("beat:every1|1000", "b1", 1, 1.1),
            run("beat:every1|2000", "b2", 2, 2.1),
        ]
    )
    assert report.ok, report.summary()
    assert report.counts["capped max running"] == 2
    assert "seed=42: OK" in report.summary()


def test_a_killed_run_ends_when_it_was_killed() -> None:
    runs = [run("ex_wait:a", "1", 0, None, fence=1, pid=77), run("ex_wait:a", "2", 3, 4, fence=2)]
    report = judge(runs, faults=[Fault("kill_child", 2 * S, 2 * S, pids=(77,))])
    assert report.ok, report.summary()
    # A kill that began before the run started but ended after it still explains it.
    report = judge(runs[:1], faults=[Fault("kill_worker", 0, int(0.5 * S), pids=(77,))])
    assert report.ok and not report.known["unfinished"], report.summary()
    # The same kill one second later: the next run started while the killed one still ran.
    report = judge(runs, faults=[Fault("kill_child", int(3.5 * S), int(3.5 * S), pids=(77,))])
    assert report.failed_checks() == ["exclusive"]


def test_a_run_that_never_ended_without_a_kill_is_reported() -> None:
    report = judge([run("capped", "1", 0, None)])
    assert report.known["unfinished"], report.summary()


def test_saturation_counts_the_time_every_pool_process_was_busy() -> None:
    runs = [run("busy", "1", 0, 4), run("busy", "2", 1, 3), run("busy", "3", 4, 4)]
    report = judge(runs, limits=Limits(pool_size=2))
    assert report.counts["pool saturated %"] == 50  # two running in [1, 3] of [0, 4]
    assert report.counts["busy runs"] == 3


def _crash(start: float, end: float, pids: tuple[int, ...] = (5, 7)) -> Fault:
    """A worker (main pid 5, pool pid 7) found dead at ``end``, its consumer gone at
    ``start``: what the nemesis records for a worker that died by itself."""
    return Fault("worker_crash", int(start * S), int(end * S), pids, "soak1@vm exited 1")


def test_a_worker_that_died_by_itself_is_judged_as_a_killed_worker() -> None:
    """The 30-minute soak's seed 1101: a worker's consumer died on a broker restart (kombu's
    hostname AttributeError) while runs were ending. Its runs are judged as a killed
    worker's: an unfinished run ends at the crash and may run again; a run that finished
    in its pool process before the crash but whose ack was not yet due was lost with its
    worker, so its unique key is its own until the broker gives the message back. The
    crash is no verdict on celery-baton, but it is counted and shown in the summary."""
    # An unfinished guarded run of the crashed worker's pool ran again: allowed.
    rerun = [run("guarded:1", "1", 0, None, pid=7), run("guarded:1", "1", 20, 21, pid=8)]
    report = judge(rerun, faults=[_crash(1.5, 3)])
    assert report.ok and not report.known["unfinished"], report.summary()
    assert report.counts["worker crashes"] == 1
    assert "WORKER CRASHES: 1 worker(s) died by themselves" in report.summary()
    assert "soak1@vm exited 1" in report.summary()
    # Without the crash the same run is unexplained (and its rerun not excused by a kill).
    assert judge(rerun).known["unfinished"]

    # A unique run that ended at 1 s, just before its worker's consumer died at 1.5 s: its
    # ack never went out; a publish deduplicated into it at 10 s is judged as one into a
    # killed run (its copy came back expired: the known window; or it ran again).
    holder = [run("uq:a", "1", 0, 1, pid=7)]
    pubs = [sent("1"), into("1", 10)]
    results = {"d": "FAILURE:TaskDeduplicated", "1": "REVOKED"}
    lost = judge(holder, published=pubs, faults=[_crash(1.5, 3)], results=results)
    assert lost.ok and lost.known["unique-expired-holder"], lost.summary()
    assert "lost with its worker at 3000000" in lost.known["unique-expired-holder"][0]
    copy = [*holder, run("uq:a", "1", 20, 21, pid=8)]
    assert judge(copy, published=pubs, faults=[_crash(1.5, 3)], results=results).ok
    # Later than the broker gives the message back, the key outlived its message.
    late = judge(holder, published=[sent("1"), into("1", 40)], faults=[_crash(1.5, 3)],
                 results=results)  # fmt: skip
    assert "gave its message back" in late.violations["accounting"][0], late.summary()
    # No crash, or one long after the run's ack went out: the key was free at 10 s.
    for faults in ([], [_crash(8, 9)], [_crash(1.5, 3, pids=(6, 8))]):
        report = judge(holder, published=pubs, faults=faults, results=results)
        assert "no longer queued or running" in report.violations["accounting"][0], faults

    # A guarded run or a beat slot that finished before the crash is done (its pool
    # process records the done marker): running it again is still a violation.
    twice = [run("guarded:1", "1", 0, 1, pid=7), run("guarded:1", "1", 20, 21, pid=8)]
    report = judge(twice, faults=[_crash(1.5, 3)])
    assert report.failed_checks() == ["guard"], report.summary()
