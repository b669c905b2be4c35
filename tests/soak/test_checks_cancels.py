"""The soak's ``cancel`` check on hand-made histories: each fails on its violation and
passes on a history that keeps the promise."""

from __future__ import annotations

from typing import Any

from tests.soak.checker import (
    Cancel,
    Fault,
    Published,
    Report,
    received_moments,
    unchecked_cancel_ids,
)
from tests.soak.histories import S, judge, run


def call(task_id: str, at: float, key: str = "a", task: str = "cancelled") -> Published:
    return Published(task_id, task, int(at * S), detail=f"key={key}")


def by_id(task_id: str, at: float, *, failed: bool = False, ttl: float = 15.0) -> Cancel:
    return Cancel(int(at * S), task_id=task_id, failed=failed, ttl=ttl)


def by_key(key: str, at: float, task: str = "cancelled", ttl: float = 15.0) -> Cancel:
    return Cancel(int(at * S), task=task, key=key, ttl=ttl)


def judged(runs: list[Any], published: list[Published], **kw: Any) -> Report:
    return judge(runs, published=published, **kw)


def test_a_call_cancelled_before_its_start_that_never_runs_and_ends_revoked_passes() -> None:
    report = judged([], [call("1", 0)], cancels=[by_id("1", 0.5)], results={"1": "REVOKED"})
    assert report.ok, report.summary()
    assert report.counts["cancelled before their start"] == 1


def test_a_call_started_later_than_the_hand_over_after_its_cancel_fails() -> None:
    runs = [run("cancelled:a", "1", 3.0, 3.2)]
    report = judged(runs, [call("1", 0)], cancels=[by_id("1", 0.5)], results={"1": "SUCCESS"})
    assert report.failed_checks() == ["cancel"]
    assert "started 2.500 s after it returned" in report.violations["cancel"][0]


def test_a_start_within_the_hand_over_is_a_known_window_not_a_pass_of_everything() -> None:
    """A grant made just before the cancel reached the store may start moments later:
    listed with its delay; its outcome is then its own."""
    runs = [run("cancelled_rated:a", "1", 0.7, 0.9)]
    report = judged(
        runs,
        [call("1", 0, task="cancelled_rated")],
        cancels=[by_id("1", 0.5)],
        results={"1": "SUCCESS"},
    )
    assert report.ok and report.known["cancel-hand-over"], report.summary()


def test_a_cancelled_call_that_never_started_must_end_revoked() -> None:
    for result in ("", "SUCCESS", "PENDING"):
        report = judged([], [call("1", 0)], cancels=[by_id("1", 0.5)], results={"1": result})
        assert report.failed_checks() == ["cancel"], result
        assert "expected REVOKED" in report.violations["cancel"][0]


def test_a_copy_of_a_killed_run_started_after_the_cancel_fails() -> None:
    """The run started before the cancel (it may), was killed with its worker, and the
    broker's copy came back after the cancel: the copy must be dropped."""
    runs = [run("cancelled:a", "1", 0.2, None, pid=7), run("cancelled:a", "1", 10, 10.3)]
    faults = [Fault("kill_worker", int(0.4 * S), int(0.45 * S), pids=(7,))]
    report = judged(
        runs, [call("1", 0)], cancels=[by_id("1", 1.0)], results={"1": "SUCCESS"}, faults=faults
    )
    assert report.failed_checks() == ["cancel"]
    assert "it had started before" in report.violations["cancel"][0]
    # The copy dropped: the run before the cancel is all there is.
    report = judged(
        runs[:1], [call("1", 0)], cancels=[by_id("1", 1.0)], results={"1": "REVOKED"}, faults=faults
    )
    assert report.ok, report.summary()


def test_a_cancel_holds_through_store_faults() -> None:
    """The soak's store keeps its data: a pause or a restart excuses no late start."""
    runs = [run("cancelled:a", "1", 9.0, 9.2)]
    for kind in ("restart_store", "pause_store"):
        faults = [Fault(kind, int(2 * S), int(8 * S))]
        report = judged(
            runs, [call("1", 0)], cancels=[by_id("1", 1)], results={"1": "SUCCESS"}, faults=faults
        )
        assert report.failed_checks() == ["cancel"], kind


def test_a_start_after_the_cancels_ttl_is_the_known_window_cancel_expired() -> None:
    runs = [run("cancelled:a", "1", 17.0, 17.2)]
    report = judged(runs, [call("1", 0)], cancels=[by_id("1", 1, ttl=15)], results={"1": "SUCCESS"})
    assert report.ok and report.known["cancel-expired"], report.summary()


def test_a_failed_cancel_is_not_judged() -> None:
    runs = [run("cancelled:a", "1", 9.0, 9.2)]
    for ran, result in ((runs, "SUCCESS"), ([], "REVOKED")):
        report = judged(
            ran, [call("1", 0)], cancels=[by_id("1", 1, failed=True)], results={"1": result}
        )
        assert report.ok, report.summary()
        assert report.counts["cancel failed, not judged"] == 1


def test_a_cancel_by_key_ends_every_call_of_its_key_published_before_it() -> None:
    published = [call("1", 0, key="k7"), call("2", 0.1, key="k7"), call("3", 0.2, key="k8")]
    results = {"1": "REVOKED", "2": "REVOKED", "3": "SUCCESS"}
    ok = [run("cancelled:k8", "3", 1, 1.2)]
    report = judged(ok, published, cancels=[by_key("k7", 0.5)], results=results)
    assert report.ok, report.summary()
    assert report.counts["cancelled before their start"] == 2
    # One of them runs 5 s later: the cancel did not stick.
    late = [*ok, run("cancelled:k7", "2", 5.5, 5.6)]
    report = judged(late, published, cancels=[by_key("k7", 0.5)], results=results)
    assert report.failed_checks() == ["cancel"]
    assert "by key k7" in report.violations["cancel"][0]
    # A call of the key published after the cut is not cancelled: it must run.
    after = [*published, call("4", 0.9, key="k7")]
    report = judged(ok, after, cancels=[by_key("k7", 0.5)], results={**results, "4": ""})
    assert report.failed_checks() == ["cancel"]
    assert "never cancelled, never ran" in report.violations["cancel"][0]
    # Another task's key of that name is not cancelled either.
    other = [call("5", 0.1, key="k7", task="cancelled_rated")]
    report = judged([], other, cancels=[by_key("k7", 0.5)], results={"5": ""})
    assert report.failed_checks() == ["cancel"]


def test_a_call_never_cancelled_runs_once_to_its_end_with_its_result() -> None:
    published = [call("1", 0)]
    report = judged([run("cancelled:a", "1", 1, 1.2)], published, results={"1": "SUCCESS"})
    assert report.ok, report.summary()
    assert not judged([], published, results={"1": ""}).ok
    assert not judged([run("cancelled:a", "1", 1, 1.2)], published, results={"1": "REVOKED"}).ok
    # Killed mid-way and run again: at least once, as acks_late promises.
    killed = [run("cancelled:a", "1", 1, None, pid=7), run("cancelled:a", "1", 20, 20.2)]
    faults = [Fault("kill_child", int(1.1 * S), int(1.1 * S), pids=(7,))]
    report = judged(killed, published, results={"1": "SUCCESS"}, faults=faults)
    assert report.ok, report.summary()
    # Finished twice: a violation, unless the first one's ack was lost.
    twice = [run("cancelled:a", "1", 1, 1.2, pid=7), run("cancelled:a", "1", 20, 20.2)]
    assert judged(twice, published, results={"1": "SUCCESS"}).failed_checks() == ["cancel"]
    for fault in (
        Fault("kill_worker", int(1.25 * S), int(1.3 * S), pids=(7,)),
        Fault("restart_broker", int(1.0 * S), int(2.0 * S)),
    ):
        report = judged(twice, published, results={"1": "SUCCESS"}, faults=[fault])
        assert report.ok and report.known["cancelled-ran-again"], report.summary()


def test_a_cancelled_call_lost_in_transport_is_a_known_window() -> None:
    """Cancelled by key (nothing marks its result but the worker that drops it), lost by
    kombu's transport as a worker was SIGKILLed: no result, no run."""
    faults = [Fault("kill_worker", int(0.05 * S), int(0.1 * S), pids=(7,))]
    report = judged(
        [], [call("1", 0, key="k1")], cancels=[by_key("k1", 0.5)], results={}, faults=faults
    )
    assert report.ok and report.known["cancelled-lost-in-transport"], report.summary()


def test_a_plain_call_screened_before_its_cancel_may_not_start_late_even_after_an_outage() -> None:
    """A plain call is screened at its delivery (Celery logs it received just before) or,
    with a countdown, when the timer hands it on; admitted then, it is asked again at
    its start when its worker heard the cancel's notice, or when the worker has not heard
    its notices lately (a notice connection that a store outage broke, reconnecting):
    a late start is a violation, outage or not (it was excused after an outage before
    the start asked the store itself). Seed 257605182: received 0.004 s after its
    publish, cancelled 0.31 s after, started 2.42 s after."""
    runs = [run("cancelled:a", "1", 3.0, 3.2)]
    results = {"1": "SUCCESS"}
    cancels = [by_id("1", 0.5)]
    before = {"1": [int(0.1 * S)]}
    report = judged(runs, [call("1", 0)], cancels=cancels, results=results, received_at=before)
    assert report.failed_checks() == ["cancel"]
    outage = [Fault("pause_store", 0, int(0.2 * S))]
    report = judged(
        runs, [call("1", 0)], cancels=cancels, results=results, received_at=before, faults=outage
    )
    assert report.failed_checks() == ["cancel"]
    # Received after the cancel: screened after it, so it must not start.
    after = {"1": [int(0.6 * S)]}
    report = judged(runs, [call("1", 0)], cancels=cancels, results=results, received_at=after)
    assert report.failed_checks() == ["cancel"]
    assert "received at 600000" in report.violations["cancel"][0]
    # A countdown whose ETA came after the cancel: handed on (screened) after it.
    countdown = Published("1", "cancelled", 0, detail="key=a countdown=1.5")
    report = judged(runs, [countdown], cancels=cancels, results=results, received_at=before)
    assert report.failed_checks() == ["cancel"]
    # A guarded call is asked again at a late start: no such window.
    rated = [call("1", 0, task="cancelled_rated")]
    runs = [run("cancelled_rated:a", "1", 3.0, 3.2)]
    report = judged(runs, rated, cancels=cancels, results=results, received_at=before)
    assert report.failed_checks() == ["cancel"]


def test_a_call_its_worker_could_not_check_is_the_known_window_cancel_store_unchecked() -> None:
    runs = [run("cancelled_rated:a", "1", 3.0, 3.2)]
    published = [call("1", 0, task="cancelled_rated")]
    cancels = [by_id("1", 0.5)]
    report = judged(
        runs, published, cancels=cancels, results={"1": "SUCCESS"}, cancel_unchecked={"1"}
    )
    assert report.ok and report.known["cancel-store-unchecked"], report.summary()
    assert not judged(runs, published, cancels=cancels, results={"1": "SUCCESS"}).ok


def test_the_workers_logs_give_the_receipts_and_the_unchecked_calls() -> None:
    log = (
        "[2026-11-29 06:44:20,738: INFO/MainProcess] Task tests.apps.soak.cancelled"
        "[efd5b7c8-7dbb-4d33-bb8d-ecf5d61a1960] received\n"
        "[2026-11-29 06:44:21,001: WARNING/MainProcess] baton: could not check whether "
        "tests.apps.soak.cancelled[0fa9df6b-5d04-4802-8ed4-0a68b45bdca6] is cancelled "
        "(Timeout); admitting it\n"
        "[2026-11-29 06:44:22,001: ERROR/ForkPoolWorker-1] baton: tests.apps.soak.cancelled_rated"
        "[540d1236-0c65-41e6-b8f8-83ebf176ecf5]: asking about a cancel failed\n"
    )
    moments = received_moments(log)
    assert list(moments) == ["efd5b7c8-7dbb-4d33-bb8d-ecf5d61a1960"]
    assert unchecked_cancel_ids(log) == {
        "0fa9df6b-5d04-4802-8ed4-0a68b45bdca6",
        "540d1236-0c65-41e6-b8f8-83ebf176ecf5",
    }
