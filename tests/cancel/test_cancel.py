"""``baton.cancel`` across real workers (issue 38 §2): a cancelled call never starts,
wherever its message is and whichever worker receives it, also one started after the
cancel; its result is REVOKED. Judged by the observer (which calls ran) and the result
backend (what a caller sees)."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import pytest
from celery import states

from tests.support.observer import Observer
from tests.support.sizes import full
from tests.support.waiting import wait_until
from tests.support.workers import Workers

APP = "tests.apps.cancel"

#: How soon a cancelled call's result must read REVOKED (the issue's bound).
REVOKED_WITHIN = 2.0

#: How long after its cancel a call admitted before it may still start: the hand-over
#: to a pool process on a loaded machine (measured up to ~60 ms at twice the cores in
#: load; a CI run at four times saw more). A cancelled call that runs at its turn starts
#: seconds later (a 5/s backlog).
HAND_OVER = 2.0

#: The countdown of the calls cancelled while they wait for it, from their publish
#: (after the workers took a backlog) to their ETA: the stopped worker's warm shutdown
#: and the cancels come in between. At four times the cores in load, the 12 s counted
#: from the test's start were over before some cancels were sent: those calls started
#: before their cancel, as they should, and read as cancelled calls that ran.
COUNTDOWN = 12.0


def cancel_timed(baton: Any, observer: Observer, results: list) -> dict[str, int]:
    """Cancel each of ``results`` by id: ``{id: the observer's clock (us) when its
    cancel returned}``, the moment by which the store had it."""
    returned = {}
    for result in results:
        baton.cancel(result.id)
        returned[result.id] = observer.now_us()
    return returned


def raced_with_cancel(observer: Observer, cancelled: dict[str, int]) -> set[str]:
    """The ids of ``cancelled`` (``{id: when its cancel returned}``, just cancelled)
    whose run started before their own cancel reached the store or within
    :data:`HAND_OVER` of it: admitted before their cancel, they run. Judged per call,
    on the observer's clock, and read once that long has passed (a snapshot taken at
    once missed one admitted and not yet started: a CI run read it as a cancelled call
    that ran)."""
    time.sleep(max(0.0, (max(cancelled.values()) - observer.now_us()) / 1e6 + HAND_OVER))
    return {
        s["task_id"]
        for s in observer.started()
        if s["task_id"] in cancelled and s["start"] <= cancelled[s["task_id"]] + HAND_OVER * 1e6
    }


def _explain(workers: Workers, observer: Observer, ids: set[str], cancelled: dict[str, int]) -> str:
    """For a failing run: each id's start against its cancel (the observer's clock), and
    every worker log line that names it (the workers log celery_baton's DEBUG lines: the
    path it took), with the logs' paths."""
    starts = {s["task_id"]: s for s in observer.started() if s["task_id"] in ids}
    parts = []
    for task_id in sorted(ids):
        start = starts.get(task_id, {})
        late = (start.get("start", 0) - cancelled.get(task_id, 0)) / 1e6
        parts.append(
            f"--- {task_id}: started {late:+.3f}s after its cancel returned, pid {start.get('pid')}"
        )
        for process in workers.started:
            lines = [line for line in process.log_text().splitlines() if task_id in line]
            if lines:
                parts.append(f"  {process.log_path}:")
                parts.extend(f"    {line}" for line in lines)
    return "\n".join(parts)


def _revoked_within(results: list, seconds: float) -> list[str]:
    """The ids not REVOKED after ``seconds``."""
    deadline = time.monotonic() + seconds
    late = [r for r in results]
    while late and time.monotonic() < deadline:
        late = [r for r in late if r.state != states.REVOKED]
        time.sleep(0.05)
    return [f"{r.id} {r.state}" for r in late if r.state != states.REVOKED]


@pytest.mark.parametrize(
    ("size", "group"),
    [
        (100, 10),
        pytest.param(
            200,
            20,
            marks=[
                pytest.mark.slow,
                pytest.mark.timeout(240),
                pytest.mark.skipif(not full(), reason="the issue's size: set BATON_FULL=1"),
            ],
        ),
    ],
    ids=["100-calls", "200-calls"],
)
def test_cancelled_calls_never_run_wherever_their_message_is(
    workers: Workers, observer: Observer, size: int, group: int
) -> None:
    """``size`` calls at 5/s over 2 workers (a backlog held in the workers) and ``group``
    with a countdown; 3 x ``group`` cancelled by id: in the broker, held in a worker, with
    a countdown; one worker stopped before the cancel, a new one started after. No
    cancelled call runs, every other runs once, each cancelled result is REVOKED within
    2 s. (The issue's figures are the slow case: 200 calls, 60 cancels.)"""
    from tests.apps import cancel

    calls = [cancel.limited.delay(n) for n in range(size)]
    in_broker = calls[size - group :]
    # No worker runs yet: these are in the broker.
    cancelled_at = cancel_timed(cancel.baton, observer, in_broker)
    assert _revoked_within(in_broker, REVOKED_WITHIN) == []

    debug = {"TEST_BATON_DEBUG": "1"}  # the path each delivery took, for a failing run
    first = workers.start(APP, concurrency=2, env=debug)
    second = workers.start(APP, concurrency=2, env=debug)
    observer.wait_for(10, timeout=60)  # the backlog is now held in the workers
    # Received at once by both workers, to wait for their ETA there (those in the one
    # stopped go back to the broker).
    countdowns = [
        cancel.limited.apply_async((size + n,), countdown=COUNTDOWN) for n in range(group)
    ]
    due = time.monotonic() + COUNTDOWN
    first.stop()  # its held messages go back to the broker

    # Held by the worker that runs (or back in the broker from the stopped one): ten
    # that have not started yet.
    started = {s["task_id"] for s in observer.started()}
    held = [r for r in calls[: size - group] if r.id not in started][-group:]
    assert len(held) == group
    just = cancel_timed(cancel.baton, observer, held + countdowns)
    cancelled_at.update(just)
    # Started before their own cancel reached the store (or within the hand-over): they
    # run, once. The rest must never start.
    raced = raced_with_cancel(observer, just)
    held = [r for r in held if r.id not in raced]
    later = [r for r in countdowns if r.id not in raced]
    assert len(held) >= group // 2, f"{group - len(held)} of {group} started before their cancel"
    assert len(later) >= group // 2, (
        f"{group - len(later)} of {group} with a countdown started before their cancel"
    )
    assert _revoked_within(held + later, REVOKED_WITHIN) == []
    # Held in the running worker: acked and announced at the notice, not at their turn
    # (seconds to a minute later at 5/s).
    wait_until(
        lambda: all(f"[{r.id}] cancelled" in second.log_text() for r in held),
        timeout=10,
        what="the held calls dropped at the cancel's notice",
    )
    workers.start(APP, concurrency=2, env=debug)  # started after the cancel: it must know of it

    cancelled = {r.id for r in in_broker + held + later}
    expected = {r.id for r in calls + countdowns} - cancelled  # the raced ones ran once
    deadline = time.monotonic() + 30 + size / 5 * 2
    while time.monotonic() < deadline:
        ran = Counter(s["task_id"] for s in observer.started())
        if set(ran) >= expected:
            break
        time.sleep(0.2)
    # Not a wait: a cancelled call that would run runs now (a countdown one at its ETA).
    time.sleep(max(2.0, due + 2.0 - time.monotonic()))
    ran = Counter(s["task_id"] for s in observer.started())
    wrongly = set(ran) & cancelled
    assert not wrongly, f"{len(wrongly)} cancelled calls ran:\n" + _explain(
        workers, observer, wrongly, cancelled_at
    )
    assert set(ran) == expected, f"{len(expected - set(ran))} calls never ran"
    assert max(ran.values()) == 1, "a call ran twice"
    for result in in_broker + held + later:
        assert result.state == states.REVOKED, result.id
    assert "cancelled (cancelled by id)" in second.log_text()


def test_a_cancel_by_key_ends_every_queued_call_of_the_key(
    workers: Workers, observer: Observer
) -> None:
    """Calls of one key queued before the cancel never run and end REVOKED; calls of
    another key, and calls of the key published after the cancel, run."""
    from tests.apps import cancel

    queued = [cancel.keyed.delay(7, n) for n in range(20)]
    others = [cancel.keyed.delay(8, n) for n in range(20)]
    cancel.baton.cancel(task=cancel.keyed, key={"account_id": 7})
    after = [cancel.keyed.delay(7, 100 + n) for n in range(5)]
    worker = workers.start(APP, concurrency=2)
    expected = {r.id for r in others + after}
    deadline = time.monotonic() + 40  # within pytest's 60 s: the assertions say what is missing
    while time.monotonic() < deadline:
        if {s["task_id"] for s in observer.started()} >= expected:
            break
        time.sleep(0.2)
    assert _revoked_within(queued, 20) == []
    ran = {s["task_id"] for s in observer.started()}
    assert not ran & {r.id for r in queued}, "a cancelled call of the key ran"
    assert ran == expected
    assert "cancelled by key" in worker.log_text()
