"""The soak's checker on hand-made histories: each check fails on its violation and passes
on a history that keeps the promise (times in seconds here, microseconds in the history)."""

from __future__ import annotations

import itertools
import time
from typing import Any

from tests.soak.checker import (
    Fault,
    History,
    Limits,
    Published,
    Report,
    Run,
    Skip,
    _worst_window,
    broker_moments,
    check,
    crash_reason,
    lost_lease_task_ids,
    merge_runs,
)

S = 1_000_000


def run(key: str, task_id: str, start: float, end: float | None, fence: int | None = None,
        pid: int = 1) -> Run:  # fmt: skip
    return Run(key, task_id, int(start * S), None if end is None else int(end * S), fence, pid)


def sent(task_id: str, at: float = 0.0, task: str = "t") -> Published:
    return Published(task_id, task, int(at * S))


def judge(runs: list[Run], **kw: Any) -> Report:
    """Check a history in which every run's task id was published (and so accounted)."""
    published = kw.pop("published", None)
    if published is None:
        published = [sent(t) for t in dict.fromkeys(r.task_id for r in runs)]
    return check(History(runs=runs, published=published, **kw), seed=42)


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


def test_concurrency_above_the_cap_fails() -> None:
    runs = [run("capped", str(i), i * 0.1, 2) for i in range(3)]
    report = judge(runs)
    assert report.failed_checks() == ["concurrency"]
    assert report.counts["capped max running"] == 3


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


def test_saturation_counts_the_time_every_pool_process_was_busy() -> None:
    runs = [run("busy", "1", 0, 4), run("busy", "2", 1, 3), run("busy", "3", 4, 4)]
    report = judge(runs, limits=Limits(pool_size=2))
    assert report.counts["pool saturated %"] == 50  # two running in [1, 3] of [0, 4]
    assert report.counts["busy runs"] == 3


def test_unique_runs_of_two_ids_at_once_fail() -> None:
    report = judge([run("uq:a", "1", 0, 3), run("uq:a", "2", 2, 4)])
    assert report.failed_checks() == ["unique"]


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


def test_a_published_task_that_never_ran_is_lost() -> None:
    report = judge([], published=[sent("1")])
    assert report.failed_checks() == ["accounting"]
    assert "never ran and is not accounted for" in report.violations["accounting"][0]


def test_a_skip_with_its_result_and_a_running_holder_accounts_for_a_task() -> None:
    report = judge(
        [run("ex_skip:a", "1", 0, 2, fence=1)],
        published=[sent("1"), sent("2")],
        skips=[Skip("2", "exclusive", int(1 * S), holder="1")],
        results={"2": "FAILURE:TaskSkipped"},
    )
    assert report.ok, report.summary()


def test_a_skip_without_a_taskskipped_result_fails() -> None:
    report = judge(
        [run("ex_skip:a", "1", 0, 2, fence=1)],
        published=[sent("1"), sent("2")],
        skips=[Skip("2", "exclusive", int(1 * S), holder="1")],
    )
    assert "expected a TaskSkipped failure" in report.violations["accounting"][0]


def test_a_skip_held_by_a_finished_run_fails() -> None:
    # The holder ended 8 s before the skip: its lease was resurrected (issue 11, item 2).
    report = judge(
        [run("ex_skip:a", "1", 0, 2, fence=1)],
        published=[sent("1"), sent("2", at=9)],
        skips=[Skip("2", "exclusive", int(10 * S), holder="1")],
        results={"2": "FAILURE:TaskSkipped"},
    )
    assert "which was not running then" in report.violations["accounting"][0]


def test_a_duplicate_published_while_its_holder_ran_may_be_skipped_later() -> None:
    # Published at 1 s while "1" ran; the store was down, the skip came at 5 s.
    report = judge(
        [run("ex_skip:a", "1", 0, 2, fence=1)],
        published=[sent("1"), sent("2", at=1)],
        skips=[Skip("2", "exclusive", int(5 * S), holder="1")],
        results={"2": "FAILURE:TaskSkipped"},
    )
    assert report.ok, report.summary()


def test_deduplication_into_a_queued_or_running_task_passes_into_a_finished_one_fails() -> None:
    holder = [run("uq:a", "1", 1, 3)]
    dedup = Published("2", "uq", int(2 * S), "deduplicated", into="1")
    results = {"2": "FAILURE:TaskDeduplicated"}
    assert judge(holder, published=[sent("1"), dedup], results=results).ok
    late = Published("2", "uq", int(20 * S), "deduplicated", into="1")
    report = judge(holder, published=[sent("1"), late], results=results)
    assert "no longer queued or running" in report.violations["accounting"][0]


def test_an_expired_task_is_accounted_for() -> None:
    report = judge([], published=[sent("1")], results={"1": "REVOKED"})
    assert report.ok and report.known["expired"], report.summary()


def test_a_failed_publish_need_not_run() -> None:
    assert judge([], published=[Published("1", "uq", 0, "failed")]).ok


def test_lost_lease_lines_name_the_task_id() -> None:
    log = (
        "[..: ERROR/MainProcess] a running task lost its lease baton:{t}:ex:k "
        "(owner 5f0c|soak1@vm|3): another run may have started\n"
        "[..: ERROR/MainProcess] lease lost: baton:{t}:cc:k held by 77aa|soak2@vm|9 was taken\n"
    )
    assert lost_lease_task_ids(log) == {"5f0c", "77aa"}


def test_merge_runs_pairs_each_start_with_its_end() -> None:
    started = [
        {"start": 1, "key": "k", "fence": 3, "task_id": "a", "pid": 5},
        {"start": 2, "key": "k", "fence": None, "task_id": "b", "pid": 6},
    ]
    finished = [{"end": 4, "start": 1, "key": "k", "fence": 3, "task_id": "a", "pid": 5}]
    assert merge_runs(started, finished) == [
        Run("k", "a", 1, 4, 3, 5),
        Run("k", "b", 2, None, None, 6),
    ]


def _into(holder: str, at: float, task_id: str = "d") -> Published:
    return Published(task_id, "uq", int(at * S), "deduplicated", into=holder)


def test_a_killed_unique_holder_keeps_its_key_until_the_broker_gives_its_message_back() -> None:
    """The soak's 'accounting' findings: dedups into a run killed with its worker, later
    than lease_ttl after the kill. The message is the broker's until it is redelivered
    (visibility_timeout): a copy that runs later accounts for them (it ran); a copy that
    came back expired was discarded (REVOKED), which freed the key: a known window, the
    duplicate's caller gets REVOKED. Never redelivered, or a dedup after the message was
    given back: the key outlived its message, a violation."""
    holder = [run("uq:a", "1", 0, None, pid=7)]
    kill = [Fault("kill_worker", int(1 * S), int(2 * S), pids=(7,))]
    results = {"d": "FAILURE:TaskDeduplicated", "1": "REVOKED"}
    late = judge(holder, published=[sent("1"), _into("1", 14)], faults=kill, results=results)
    assert late.ok and late.known["unique-expired-holder"], late.summary()

    ran_again = [*holder, run("uq:a", "1", 20, 21)]
    report = judge(ran_again, published=[sent("1"), _into("1", 14)], faults=kill, results=results)
    assert report.ok and not report.known["unique-expired-holder"], report.summary()

    lost = judge(holder, published=[sent("1"), _into("1", 14)], faults=kill,
                 results={"d": "FAILURE:TaskDeduplicated"})  # fmt: skip
    assert "result is missing" in lost.violations["accounting"][0], lost.summary()

    after = judge(holder, published=[sent("1"), _into("1", 60)], faults=kill, results=results)
    assert "gave its message back" in after.violations["accounting"][0], after.summary()


def test_an_expiring_unique_holder_killed_with_its_worker_holds_its_key_for_lease_ttl() -> None:
    """Its run held the claim while it lived: a dedup within lease_ttl of the kill is the
    known window (the caller gets REVOKED); one later means the claim outlived its run."""
    holder = [run("uq:a", "1", 0, None, pid=7)]
    kill = [Fault("kill_worker", int(1 * S), int(2 * S), pids=(7,))]
    results = {"d": "FAILURE:TaskDeduplicated", "1": "REVOKED"}
    expiring = Published("1", "uq", 0, detail="expires=2")
    soon = judge(holder, published=[expiring, _into("1", 5)], faults=kill, results=results)
    assert soon.ok and soon.known["unique-expired-holder"], soon.summary()
    late = judge(holder, published=[expiring, _into("1", 14)], faults=kill, results=results)
    assert "lease_ttl" in late.violations["accounting"][0], late.summary()


def test_a_unique_holder_whose_ack_waited_on_the_broker_still_holds_its_key() -> None:
    """A run that ended while the broker was SIGSTOPped: Celery acks first, then the key
    is freed, so the key is held until the broker answers again (and no longer)."""
    holder = [run("uq:a", "1", 0, 2)]
    pause = [Fault("pause_broker", int(1.9 * S), int(9.9 * S))]
    results = {"d": "FAILURE:TaskDeduplicated"}
    ok = judge(holder, published=[sent("1"), _into("1", 10)], faults=pause, results=results)
    assert ok.ok, ok.summary()
    late = judge(holder, published=[sent("1"), _into("1", 20)], faults=pause, results=results)
    assert "no longer queued or running" in late.violations["accounting"][0], late.summary()


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
    pubs = [sent("1"), _into("1", 10)]
    results = {"d": "FAILURE:TaskDeduplicated", "1": "REVOKED"}
    lost = judge(holder, published=pubs, faults=[_crash(1.5, 3)], results=results)
    assert lost.ok and lost.known["unique-expired-holder"], lost.summary()
    assert "lost with its worker at 3000000" in lost.known["unique-expired-holder"][0]
    copy = [*holder, run("uq:a", "1", 20, 21, pid=8)]
    assert judge(copy, published=pubs, faults=[_crash(1.5, 3)], results=results).ok
    # Later than the broker gives the message back, the key outlived its message.
    late = judge(holder, published=[sent("1"), _into("1", 40)], faults=[_crash(1.5, 3)],
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


def test_a_run_that_ends_in_the_pool_while_kill_worker_runs_is_lost_with_its_worker() -> None:
    """kill_worker SIGKILLs the main process, then its pool: a pool process may end a run
    in between (strict soak, seed 2202: a beat tick ended 23 ms into the kill). Its ack
    never went out: for the accounting the run is lost with its worker, as in a crash."""
    holder = [run("uq:a", "1", 0, 1.02, pid=7)]
    kill = [Fault("kill_worker", int(1 * S), int(1.05 * S), pids=(5, 7))]
    pubs = [sent("1"), _into("1", 6)]
    results = {"d": "FAILURE:TaskDeduplicated", "1": "REVOKED"}
    lost = judge(holder, published=pubs, faults=kill, results=results)
    assert lost.ok and lost.known["unique-expired-holder"], lost.summary()
    assert lost.counts["worker crashes"] == 0 and "WORKER CRASHES" not in lost.summary()
    # A pool child killed alone: its main process recorded every run that ended.
    child = [Fault("kill_child", int(1 * S), int(1.05 * S), pids=(7,))]
    report = judge(holder, published=pubs, faults=child, results=results)
    assert "no longer queued or running" in report.violations["accounting"][0]


def test_crash_reason_reads_celerys_unrecoverable_error_line() -> None:
    log = (
        "[2025-11-23 14:57:01,100: INFO/MainProcess] Connected to redis://127.0.0.1:1/0\n"
        "[2025-11-23 14:57:03,250: CRITICAL/MainProcess] Unrecoverable error: "
        "AttributeError(\"'NoneType' object has no attribute 'hostname'\")\n"
        "Traceback (most recent call last):\n"
        "AttributeError: 'NoneType' object has no attribute 'hostname'\n"
    )
    reason, at = crash_reason(log)
    assert reason.startswith("Unrecoverable error: AttributeError(")
    assert at is not None
    assert time.strftime("%H:%M:%S", time.localtime(at)) == "14:57:03"
    assert round(at % 1, 3) == 0.25
    assert crash_reason("Traceback:\nMemoryError: out\n") == ("MemoryError: out", None)
    assert crash_reason("") == ("", None)


def test_a_holder_that_ended_while_the_store_was_paused_holds_its_key_until_it_answers() -> None:
    """A run that ended while the store was SIGSTOPped: its release (the unique claim
    freed, its exclusive lease) reaches the store once it answers again, within the
    worker's retry interval; until then the key is still its own (and no longer)."""
    holder = [run("uq:a", "1", 0, 2)]
    pause = [Fault("pause_store", int(1 * S), int(8.6 * S))]
    results = {"d": "FAILURE:TaskDeduplicated"}
    ok = judge(holder, published=[sent("1"), _into("1", 8.9)], faults=pause, results=results)
    assert ok.ok, ok.summary()
    late = judge(holder, published=[sent("1"), _into("1", 14)], faults=pause, results=results)
    assert "no longer queued or running" in late.violations["accounting"][0], late.summary()

    exclusive = [run("ex_skip:a", "1", 0, 2, fence=1)]
    skipped = {"2": "FAILURE:TaskSkipped"}
    soon = judge(
        exclusive,
        published=[sent("1"), sent("2", at=8.8)],
        skips=[Skip("2", "exclusive", int(8.9 * S), holder="1")],
        faults=pause,
        results=skipped,
    )
    assert soon.ok, soon.summary()
    later = judge(
        exclusive,
        published=[sent("1"), sent("2", at=13)],
        skips=[Skip("2", "exclusive", int(14 * S), holder="1")],
        faults=pause,
        results=skipped,
    )
    assert "which was not running then" in later.violations["accounting"][0], later.summary()


def test_a_task_published_as_a_worker_was_killed_and_never_received_is_a_known_window() -> None:
    """kombu's Redis transport pops a message (BRPOP) before it records it as unacked: a
    worker SIGKILLed in between loses it unseen. Known (not ours), but only then."""
    kill = [Fault("kill_worker", int(10 * S), int(10.04 * S), (5, 7), "soak2@vm")]
    at_kill = judge([], published=[sent("1", at=10.02)], faults=kill)
    assert at_kill.ok and at_kill.known["lost-in-transport"], at_kill.summary()
    later = judge([], published=[sent("1", at=12)], faults=kill)
    assert "never ran and is not accounted for" in later.violations["accounting"][0]
    # Only if no worker logged it received: one that did was celery-baton's to keep.
    received = judge([], published=[sent("1", at=10.02)], faults=kill, received={"1"})
    assert "never ran and is not accounted for" in received.violations["accounting"][0]


def test_a_task_published_before_the_broker_was_killed_may_be_lost_in_transport() -> None:
    """A broker SIGKILLed after the publish, as a worker had just taken the message off
    the queue (BRPOP executed and logged, its reply or the unacked record lost): kombu
    lost it before Celery saw it (20-minute soak, seed 1105: two tasks published 0.13 s
    and 0.49 s before a restart_broker). Known only if no worker logged it received."""
    restart = [Fault("restart_broker", int(10 * S), int(11 * S))]
    lost = judge([], published=[sent("1", at=9.5)], faults=restart, received=set())
    assert lost.ok and lost.known["lost-in-transport"], lost.summary()
    assert "+0.500 s from a restart_broker" in lost.known["lost-in-transport"][0]
    for published, received in ((9.5, {"1"}), (10.5, set()), (-30.0, set())):
        report = judge([], published=[sent("1", at=published)], faults=restart,
                       received=received)  # fmt: skip
        assert "not accounted for" in report.violations["accounting"][0], (published, received)


def test_a_held_message_handed_back_just_before_a_broker_kill_may_be_lost_in_transport() -> None:
    """Seed 1112: a message received and held, handed back to the broker (at the hold
    horizon, or put back after a reconnect), and the broker SIGKILLed moments later,
    as the message was being delivered again: kombu's window, as for a first delivery.
    Known only if no worker logged it after the hand-back, and the kill came within
    seconds of it."""
    restart = [Fault("restart_broker", int(10 * S), int(11 * S))]
    kw: dict[str, Any] = {"published": [sent("1", at=1.0)], "faults": restart}
    lost = judge([], received={"1"}, to_broker={"1": int(9.8 * S)}, **kw)
    assert lost.ok and lost.known["lost-in-transport"], lost.summary()
    assert "0.200 s before a restart_broker" in lost.known["lost-in-transport"][0]
    for handed in ({}, {"1": int(5.0 * S)}, {"1": int(10.8 * S)}):
        report = judge([], received={"1"}, to_broker=handed, **kw)
        assert "not accounted for" in report.violations["accounting"][0], handed


def test_broker_moments_name_each_ids_last_moment_and_whether_it_went_to_the_broker() -> None:
    a, b, c = (f"{n}" * 8 + "-aaaa-bbbb-cccc-" + f"{n}" * 12 for n in "123")
    log = (
        f"[2026-11-27 07:13:27,791: INFO/MainProcess] Task t.x[{a}] received\n"
        f"[2026-11-27 07:13:27,800: INFO/MainProcess] Task t.x[{b}] received\n"
        f"[2026-11-27 07:13:28,000: WARNING/MainProcess] t.x[{b}] handed back to the broker: "
        "held 5s, the horizon\n"
        f"[2026-11-27 07:13:31,231: INFO/MainProcess] baton: 2 held messages put back in "
        f"their queues (the broker could not take them back when the connection was lost): "
        f"{a}, {c}\n"
        f"[2026-11-27 07:13:31,500: INFO/MainProcess] Task t.x[{c}] received\n"
    )
    moments = broker_moments(log)
    assert moments[a][1] and not moments[c][1] and moments[b][1]
    assert moments[c][0] - moments[a][0] == int(0.269 * S)


def test_a_unique_run_acked_as_its_worker_died_keeps_its_claim_as_a_known_window() -> None:
    """Without the guard a unique run's claim is released after its ack (a run whose ack
    failed runs again, and keeps its key for that copy); a worker SIGKILLed between the
    two leaves the claim to a finished task. Known, but only right at a worker's death."""
    holder = [run("uq:a", "1", 0, 1.0, pid=7)]
    pubs = [sent("1"), _into("1", 20)]
    done = {"d": "FAILURE:TaskDeduplicated", "1": "SUCCESS"}
    kill = [Fault("kill_worker", int(1.1 * S), int(1.15 * S), pids=(5, 7))]
    at_kill = judge(holder, published=pubs, faults=kill, results=done)
    assert at_kill.ok and at_kill.known["unique-claim-after-ack"], at_kill.summary()
    assert "0.100 s after the run ended (kill_worker)" in at_kill.known["unique-claim-after-ack"][0]
    # A second after its end, the release had gone out long before: a violation.
    late_kill = [Fault("kill_worker", int(2.0 * S), int(2.05 * S), pids=(5, 7))]
    report = judge(holder, published=pubs, faults=late_kill, results=done)
    assert report.violations["accounting"], report.summary()
    # Another worker's death says nothing about this run's claim.
    other = [Fault("kill_worker", int(1.1 * S), int(1.15 * S), pids=(6, 8))]
    report = judge(holder, published=pubs, faults=other, results=done)
    assert report.violations["accounting"], report.summary()
