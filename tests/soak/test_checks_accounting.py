"""The soak's ``accounting`` check on hand-made histories: it fails on a published task
that is not accounted for and passes on a history that accounts for each, its known
windows apart."""

from __future__ import annotations

from typing import Any

from tests.soak.checker import Fault, Published, Skip
from tests.soak.histories import S, into, judge, run, sent


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
    late = judge(holder, published=[sent("1"), into("1", 14)], faults=kill, results=results)
    assert late.ok and late.known["unique-expired-holder"], late.summary()

    ran_again = [*holder, run("uq:a", "1", 20, 21)]
    report = judge(ran_again, published=[sent("1"), into("1", 14)], faults=kill, results=results)
    assert report.ok and not report.known["unique-expired-holder"], report.summary()

    lost = judge(holder, published=[sent("1"), into("1", 14)], faults=kill,
                 results={"d": "FAILURE:TaskDeduplicated"})  # fmt: skip
    assert "result is missing" in lost.violations["accounting"][0], lost.summary()

    after = judge(holder, published=[sent("1"), into("1", 60)], faults=kill, results=results)
    assert "gave its message back" in after.violations["accounting"][0], after.summary()


def test_a_unique_holder_whose_ack_met_a_broker_outage_keeps_its_key_for_its_copy() -> None:
    """Seed 212954746: a run ended as the broker restarted; its ack failed, and its claim
    was kept for the copy the broker gives back (which came back expired and was
    discarded). A dedup then is the known window; without a broker outage at its end, or
    past the redelivery window, it is a violation."""
    holder = [run("uq:a", "1", 0, 1)]
    outage = [Fault("restart_broker", int(0.9 * S), int(3 * S))]
    results = {"d": "FAILURE:TaskDeduplicated", "1": "SUCCESS"}
    kept = judge(holder, published=[sent("1"), into("1", 14)], faults=outage, results=results)
    assert kept.ok and kept.known["unique-expired-holder"], kept.summary()

    acked = judge(holder, published=[sent("1"), into("1", 14)], results=results)
    assert "no longer queued or running" in acked.violations["accounting"][0], acked.summary()

    after = judge(holder, published=[sent("1"), into("1", 60)], faults=outage, results=results)
    assert "redelivery window" in after.violations["accounting"][0], after.summary()

    # Seed 263512648: a broker pause inside the window delays the copy by its length.
    pause = Fault("pause_broker", int(18 * S), int(26 * S))
    delayed = judge(
        holder, published=[sent("1"), into("1", 32)], faults=[*outage, pause], results=results
    )
    assert delayed.ok and delayed.known["unique-expired-holder"], delayed.summary()
    undelayed = judge(holder, published=[sent("1"), into("1", 32)], faults=outage, results=results)
    assert "redelivery window" in undelayed.violations["accounting"][0], undelayed.summary()

    # Seed 993991265: a pause longer than the client's socket timeout fails the ack too;
    # a short one only delays it.
    long_pause = [Fault("pause_broker", int(0.5 * S), int(7.6 * S))]
    paused = judge(holder, published=[sent("1"), into("1", 14)], faults=long_pause, results=results)
    assert paused.ok and paused.known["unique-expired-holder"], paused.summary()
    short_pause = [Fault("pause_broker", int(0.5 * S), int(2 * S))]
    waited = judge(
        holder, published=[sent("1"), into("1", 14)], faults=short_pause, results=results
    )
    assert "no longer queued or running" in waited.violations["accounting"][0], waited.summary()


def test_an_expiring_unique_holder_killed_with_its_worker_holds_its_key_for_lease_ttl() -> None:
    """Its run held the claim while it lived: a dedup within lease_ttl of the kill is the
    known window (the caller gets REVOKED); one later means the claim outlived its run."""
    holder = [run("uq:a", "1", 0, None, pid=7)]
    kill = [Fault("kill_worker", int(1 * S), int(2 * S), pids=(7,))]
    results = {"d": "FAILURE:TaskDeduplicated", "1": "REVOKED"}
    expiring = Published("1", "uq", 0, detail="expires=2")
    soon = judge(holder, published=[expiring, into("1", 5)], faults=kill, results=results)
    assert soon.ok and soon.known["unique-expired-holder"], soon.summary()
    late = judge(holder, published=[expiring, into("1", 14)], faults=kill, results=results)
    assert "lease_ttl" in late.violations["accounting"][0], late.summary()


def test_a_unique_holder_whose_ack_waited_on_the_broker_still_holds_its_key() -> None:
    """A run that ended while the broker was SIGSTOPped: Celery acks first, then the key
    is freed, so the key is held until the broker answers again (and no longer)."""
    holder = [run("uq:a", "1", 0, 2)]
    # (It ends within the client's socket timeout of the run's end: a longer pause fails
    # the ack: see the broker outage test above.)
    pause = [Fault("pause_broker", int(1.9 * S), int(5.9 * S))]
    results = {"d": "FAILURE:TaskDeduplicated"}
    ok = judge(holder, published=[sent("1"), into("1", 7)], faults=pause, results=results)
    assert ok.ok, ok.summary()
    late = judge(holder, published=[sent("1"), into("1", 20)], faults=pause, results=results)
    assert "no longer queued or running" in late.violations["accounting"][0], late.summary()


def test_a_run_that_ends_in_the_pool_while_kill_worker_runs_is_lost_with_its_worker() -> None:
    """kill_worker SIGKILLs the main process, then its pool: a pool process may end a run
    in between (strict soak, seed 2202: a beat tick ended 23 ms into the kill). Its ack
    never went out: for the accounting the run is lost with its worker, as in a crash."""
    holder = [run("uq:a", "1", 0, 1.02, pid=7)]
    kill = [Fault("kill_worker", int(1 * S), int(1.05 * S), pids=(5, 7))]
    pubs = [sent("1"), into("1", 6)]
    results = {"d": "FAILURE:TaskDeduplicated", "1": "REVOKED"}
    lost = judge(holder, published=pubs, faults=kill, results=results)
    assert lost.ok and lost.known["unique-expired-holder"], lost.summary()
    assert lost.counts["worker crashes"] == 0 and "WORKER CRASHES" not in lost.summary()
    # A pool child killed alone: its main process recorded every run that ended.
    child = [Fault("kill_child", int(1 * S), int(1.05 * S), pids=(7,))]
    report = judge(holder, published=pubs, faults=child, results=results)
    assert "no longer queued or running" in report.violations["accounting"][0]


def test_a_holder_that_ended_while_the_store_was_paused_holds_its_key_until_it_answers() -> None:
    """A run that ended while the store was SIGSTOPped: its release (the unique claim
    freed, its exclusive lease) reaches the store once it answers again, within the
    worker's retry interval; until then the key is still its own (and no longer)."""
    holder = [run("uq:a", "1", 0, 2)]
    pause = [Fault("pause_store", int(1 * S), int(8.6 * S))]
    results = {"d": "FAILURE:TaskDeduplicated"}
    ok = judge(holder, published=[sent("1"), into("1", 8.9)], faults=pause, results=results)
    assert ok.ok, ok.summary()
    late = judge(holder, published=[sent("1"), into("1", 14)], faults=pause, results=results)
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


def test_a_unique_run_acked_as_its_worker_died_keeps_its_claim_as_a_known_window() -> None:
    """Without the guard a unique run's claim is released after its ack (a run whose ack
    failed runs again, and keeps its key for that copy); a worker SIGKILLed between the
    two leaves the claim to a finished task. Known, but only right at a worker's death."""
    holder = [run("uq:a", "1", 0, 1.0, pid=7)]
    pubs = [sent("1"), into("1", 20)]
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


def test_a_coalesced_beat_slot_is_accounted_for_by_a_later_slot_that_ran() -> None:
    tick = "tests.apps.soak.tick"
    coalesced = Skip("old", "misfire", int(3 * S), task=tick)
    report = judge(
        [run("beat:every1|5000", "new", 3.2, 3.3)],
        published=[sent("new")],
        skips=[coalesced],
    )
    assert report.ok, report.summary()
    assert report.known["coalesced-late-slot"]


def test_a_coalesced_beat_slot_with_no_later_run_fails() -> None:
    report = judge(
        [run("beat:every1|1000", "older", 0.5, 0.6)],
        skips=[Skip("old", "misfire", int(3 * S), task="tests.apps.soak.tick")],
    )
    assert "no later slot ran" in report.violations["accounting"][0]


def test_a_copy_of_a_coalesced_beat_slot_skipped_as_already_run_is_accounted_for() -> None:
    tick = "tests.apps.soak.tick"
    report = judge(
        [run("beat:every1|5000", "new", 3.2, 3.3)],
        published=[sent("new")],
        skips=[
            Skip("old", "misfire", int(3 * S), task=tick),
            Skip("old", "already-run", int(3.1 * S), task=tick),
        ],
    )
    assert report.ok, report.summary()
