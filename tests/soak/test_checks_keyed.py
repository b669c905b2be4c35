"""The soak's ``ordered`` and ``batched`` checks on hand-made histories: each fails on its
violation, naming the key and the calls, and passes on a history that keeps the promise
(with what the guarantees allow: a refusal after the gap bound, a killed run run again)."""

from __future__ import annotations

from typing import Any

from tests.soak.checker import Fault, History, Published, Report, Run, Skip, check
from tests.soak.checks.records import ordered_log_notes
from tests.soak.histories import S, run

GAP_LINE = '{"key":"p"}'  # the key's label as the worker logs it


def ordered(seq: int, at: float, key: str = "p") -> Published:
    return Published(f"o{key}{seq}", "inorder", int(at * S), detail=f"key={key} seq={seq}")


def batched(n: int, at: float, key: str = "x") -> Published:
    return Published(f"b{n}", "batched", int(at * S), detail=f"key={key} n={n}")


def judge(runs: list[Run], published: list[Published], **kw: Any) -> Report:
    """Every call's result is its own unless ``results``/``values`` say otherwise."""
    results = {p.task_id: "SUCCESS" for p in published}
    values: dict[str, Any] = {}
    for p in published:
        fields = dict(part.split("=") for part in p.detail.split())
        values[p.task_id] = (
            int(fields["seq"])
            if p.task == "inorder"
            else f"{fields['key']}:{fields['n']}:{p.task_id}"
        )
    results.update(kw.pop("results", {}))
    values.update(kw.pop("values", {}))
    history = History(runs=runs, published=published, results=results, values=values, **kw)
    return check(history, seed=42)


# -- ordered --------------------------------------------------------------------------


def in_order() -> tuple[list[Run], list[Published]]:
    published = [ordered(1, 0.0), ordered(2, 0.1), ordered(3, 0.2), ordered(1, 0.3, key="q")]
    runs = [
        run("inorder:p", "op1", 1, 2),
        run("inorder:q", "oq1", 1.5, 2.5),  # another key: in parallel
        run("inorder:p", "op2", 2.01, 3),
        run("inorder:p", "op3", 3.5, 4),
    ]
    return runs, published


def test_ordered_calls_in_publish_order_one_at_a_time_pass() -> None:
    runs, published = in_order()
    report = judge(runs, published)
    assert report.ok, report.summary()
    assert report.counts["ordered calls"] == 4


def test_an_inversion_names_the_key_and_both_positions() -> None:
    runs, published = in_order()
    runs[2] = run("inorder:p", "op2", 3.5, 3.6)
    runs[3] = run("inorder:p", "op3", 2.01, 3)
    report = judge(runs, published)
    assert report.failed_checks() == ["ordered"]
    (found,) = report.violations["ordered"]
    assert "key 'p': seq 2 (op2) started at 3500000, after seq 3 (op3)" in found
    assert "publish order inverted" in found


def test_an_overlap_of_two_calls_of_a_key_is_a_violation() -> None:
    runs, published = in_order()
    runs[2] = run("inorder:p", "op2", 1.9, 3)
    report = judge(runs, published)
    assert report.failed_checks() == ["ordered"]
    assert (
        "key 'p': seq 1 (op1) [1000000, 2000000) overlaps seq 2 (op2)"
        in (report.violations["ordered"][0])
    )


def test_a_call_run_to_its_end_twice_is_a_violation() -> None:
    runs, published = in_order()
    runs.insert(3, run("inorder:p", "op2", 3.1, 3.2))
    report = judge(runs, published)
    assert report.failed_checks() == ["ordered"]
    assert "key 'p': seq 2 (op2) ran to its end twice" in report.violations["ordered"][0]


def test_a_killed_run_that_runs_again_before_the_next_passes() -> None:
    runs, published = in_order()
    runs[2] = run("inorder:p", "op2", 2.01, None, pid=7)
    runs.insert(3, run("inorder:p", "op2", 3.1, 3.2))
    kill = Fault("kill_child", int(2.5 * S), int(2.6 * S), pids=(7,))
    report = judge(runs, published, faults=[kill])
    assert report.ok, report.summary()


def test_a_killed_run_that_runs_again_after_the_next_is_an_inversion() -> None:
    runs, published = in_order()
    runs[2] = run("inorder:p", "op2", 2.01, None, pid=7)
    runs.append(run("inorder:p", "op2", 4.5, 4.6))
    kill = Fault("kill_child", int(2.5 * S), int(2.6 * S), pids=(7,))
    report = judge(runs, published, faults=[kill])
    assert report.failed_checks() == ["ordered"]
    assert "seq 2 (op2) started at 4500000, after seq 3 (op3)" in report.violations["ordered"][0]


def refused(at: float) -> Skip:
    return Skip("op2", "out-of-order", int(at * S), task="tests.apps.soak.inorder")


def gap_skipped() -> tuple[list[Run], list[Published]]:
    """Call 2 of key p never came in time: call 3 ran 31 s after call 1 ended."""
    runs, published = in_order()
    del runs[2]
    runs[2] = run("inorder:p", "op3", 33, 34)
    return runs, published


def test_a_call_refused_after_the_gap_bound_is_allowed() -> None:
    runs, published = gap_skipped()
    report = judge(
        runs,
        published,
        skips=[refused(40)],
        results={"op2": "FAILURE:TaskSkipped"},
        order_skips=[(GAP_LINE, "2", 32 * S)],
    )
    assert report.ok, report.summary()
    assert report.counts["ordered refused (gap bound)"] == 1
    assert (
        "the key's gap skip was logged 30.0 s after seq 2 (op2) became next"
        in (report.known["ordered-refused"][0])
    )


def test_a_skip_within_the_gap_bound_is_a_violation() -> None:
    runs, published = gap_skipped()
    runs[2] = run("inorder:p", "op3", 7, 8)  # 5 s after call 1 ended; the bound is 30 s
    report = judge(
        runs,
        published,
        skips=[refused(9)],
        results={"op2": "FAILURE:TaskSkipped"},
        order_skips=[(GAP_LINE, "2", int(6.5 * S))],
    )
    assert report.failed_checks() == ["ordered"]
    (found,) = report.violations["ordered"]
    assert "key 'p': seq 2 (op2) refused at 9000000" in found
    assert "seq 3 (op3) started 5.0 s after seq 2 (op2) became next" in found


def test_a_skip_logged_within_the_gap_bound_is_a_violation_before_any_later_call_ran() -> None:
    runs, published = gap_skipped()
    del runs[2], published[2]  # call 3 not published yet
    report = judge(
        runs,
        published,
        skips=[refused(9)],
        results={"op2": "FAILURE:TaskSkipped"},
        order_skips=[(GAP_LINE, "2", int(6.5 * S))],
    )
    (found,) = report.violations["ordered"]
    assert "the key's latest gap skip before it was logged 4.5 s after seq 2 (op2)" in found


def test_the_gap_bound_counts_from_the_publish_of_a_call_after_an_idle_key() -> None:
    """Key idle since call 1 ended (2 s); call 2 published at 50 s: its position was
    not next before it was given, so a skip at 60 s undercuts the bound."""
    runs, published = in_order()
    published[1] = ordered(2, 50)
    published[2] = ordered(3, 50.1)
    runs[2] = run("inorder:p", "op3", 60.5, 61)
    del runs[3]
    report = judge(
        runs,
        published,
        skips=[refused(62)],
        results={"op2": "FAILURE:TaskSkipped"},
        order_skips=[(GAP_LINE, "2", 60 * S)],
    )
    (found,) = report.violations["ordered"]
    assert "seq 3 (op3) started 10.5 s after seq 2 (op2) became next (at the latest 50000000)" in (
        found
    )


def test_later_positions_go_with_the_first_missing_one() -> None:
    """Calls 2 and 3 both missing: the skip that passed the bound for 2 takes 3 too,
    though 3 was published only 5 s before."""
    runs, published = gap_skipped()
    published.insert(3, ordered(4, 28))
    published[2] = ordered(3, 27)
    runs[2] = run("inorder:p", "op4", 33, 34)
    report = judge(
        runs,
        published,
        skips=[refused(40), Skip("op3", "out-of-order", 41 * S, task="tests.apps.soak.inorder")],
        results={"op2": "FAILURE:TaskSkipped", "op3": "FAILURE:TaskSkipped"},
        order_skips=[(GAP_LINE, "2-3", 32 * S)],
    )
    assert report.ok, report.summary()
    assert len(report.known["ordered-refused"]) == 2


def test_a_refusal_without_the_workers_gap_line_or_its_result_is_a_violation() -> None:
    runs, published = gap_skipped()
    report = judge(runs, published, skips=[refused(40)], results={"op2": ""})
    found = "\n".join(report.violations["ordered"])
    assert "but its result is missing (expected TaskSkipped)" in found
    assert "no worker logged a gap skip of key 'p'" in found


def test_a_refusal_before_the_skip_was_logged_is_a_violation() -> None:
    runs, published = gap_skipped()
    report = judge(
        runs,
        published,
        skips=[refused(20)],
        results={"op2": "FAILURE:TaskSkipped"},
        order_skips=[(GAP_LINE, "2", 32 * S)],
    )
    assert "no worker logged a gap skip of key 'p' before" in report.violations["ordered"][0]


def test_a_call_that_never_ran_and_was_not_refused_is_a_violation() -> None:
    runs, published = gap_skipped()
    report = judge(runs, published, results={"op2": ""}, received={"op2"})
    assert report.failed_checks() == ["ordered"]
    assert (
        "key 'p': seq 2 (op2) published at 100000 never ran to its end"
        in (report.violations["ordered"][0])
    )


def test_a_call_lost_in_the_transport_window_of_a_worker_kill_is_a_known_window() -> None:
    runs, published = gap_skipped()
    kill = Fault("kill_worker", int(0.05 * S), int(0.2 * S), pids=(99,))
    report = judge(runs, published, results={"op2": ""}, received=set(), faults=[kill])
    assert report.ok, report.summary()
    assert report.known["ordered-lost-in-transport"]


def test_an_ordered_result_that_is_not_the_calls_own_is_a_violation() -> None:
    runs, published = in_order()
    report = judge(runs, published, values={"op2": 3})
    assert (
        "key 'p': seq 2 (op2) ran, but its result is SUCCESS (3)"
        in (report.violations["ordered"][0])
    )


# -- batched --------------------------------------------------------------------------


def two_batches() -> tuple[list[Run], list[Published]]:
    published = [batched(n, n * 0.01) for n in range(1, 6)] + [batched(6, 0.1, key="y")]
    runs = [
        run("batched:x", "b1,b2,b3", 0.5, 0.8),
        run("batched:y", "b6", 0.6, 0.9),
        run("batched:x", "b4,b5", 0.9, 1.0),
    ]
    return runs, published


def test_every_call_in_one_successful_batch_with_its_own_result_passes() -> None:
    runs, published = two_batches()
    report = judge(runs, published)
    assert report.ok, report.summary()
    assert report.counts["batch runs"] == 3


def test_a_call_in_two_successful_batches_is_a_violation() -> None:
    runs, published = two_batches()
    runs.append(run("batched:x", "b3,b4", 2, 2.1))
    report = judge(runs, published)
    assert report.failed_checks() == ["batched"]
    found = report.violations["batched"]
    assert len(found) == 2
    assert "key 'x': n 3 (b3) ran in two successful batches" in found[0]


def test_a_batch_killed_right_after_its_body_ended_may_run_again() -> None:
    runs, published = two_batches()
    runs[0] = run("batched:x", "b1,b2,b3", 0.5, 0.8, pid=7)
    runs.append(run("batched:x", "b1,b2,b3", 8, 8.1))
    kill = Fault("kill_child", int(0.85 * S), int(0.9 * S), pids=(7,))
    report = judge(runs, published, faults=[kill])
    assert report.ok, report.summary()
    assert len(report.known["batched-twice"]) == 3


def test_a_batch_that_mixed_keys_is_a_violation() -> None:
    runs, published = two_batches()
    runs[1] = run("batched:x|y", "b4,b6", 0.6, 0.9)
    runs[2] = run("batched:x", "b5", 0.9, 1.0)
    report = judge(runs, published)
    found = "\n".join(report.violations["batched"])
    assert "a batch run mixed keys ['x', 'y']" in found


def test_a_call_in_no_successful_batch_is_a_violation() -> None:
    runs, published = two_batches()
    runs[2] = run("batched:x", "b4,b5", 0.9, None, pid=7)  # killed, never ran again
    kill = Fault("kill_child", int(0.95 * S), int(1.0 * S), pids=(7,))
    report = judge(runs, published, faults=[kill], results={"b4": "", "b5": ""})
    found = report.violations["batched"]
    assert len(found) == 2
    assert "key 'x': n 4 (b4) published at 40000 ended in no successful batch" in found[0]
    assert "killed runs: b4,b5" in found[0]


def test_a_caller_that_got_another_calls_result_is_a_violation() -> None:
    runs, published = two_batches()
    report = judge(runs, published, values={"b2": "x:3:b3"})
    (found,) = report.violations["batched"]
    assert "key 'x': n 2 (b2) ran, but its caller got SUCCESS ('x:3:b3', not 'x:2:b2')" in found


def test_the_workers_ordered_lines_are_read_back() -> None:
    text = (
        '[2026-11-28 14:00:00,000: WARNING/MainProcess] baton: ordered key {"key":"p"} '
        "of tests.apps.soak.inorder skipped position 12-13: its call did not come within "
        "ordered_gap_timeout (expired, revoked or lost before a worker took it); position 14"
        " runs next, and a skipped call is refused if it comes\n"
        "[2026-11-28 14:00:01,000: WARNING/MainProcess] baton: tests.apps.soak.inorder"
        "[0b8b2c1e-1111-2222-3333-444455556666] of ordered key inorder(key='q') was placed "
        "under an order record the store no longer has (restarted without its data, or "
        "expired): it runs in arrival order, one at a time\n"
    )
    skips, lost = ordered_log_notes(text)
    assert [s[:2] for s in skips] == [('{"key":"p"}', "12-13")]
    assert lost == {"0b8b2c1e-1111-2222-3333-444455556666"}


def test_a_call_whose_publish_raised_may_run_in_its_place_or_not_at_all() -> None:
    runs, published = in_order()
    published[1] = Published(
        "op2", "inorder", int(0.1 * S), "failed", detail="key=p seq=2 OperationalError('x=1')"
    )
    assert judge(runs, published).ok
    del runs[2]
    report = judge(runs, published, results={"op2": ""})
    assert report.ok, report.summary()
