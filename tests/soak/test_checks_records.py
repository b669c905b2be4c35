"""The history's records read back: the observer's entries as runs, and what the workers'
log lines say (lost leases, why a worker died, when a task was handed to the broker)."""

from __future__ import annotations

import time

from tests.soak.checker import Run, broker_moments, crash_reason, lost_lease_task_ids, merge_runs
from tests.soak.histories import S


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


def test_broker_moments_read_the_backlog_handed_back_at_a_store_wide_holds_end() -> None:
    a, b = (f"{n}" * 8 + "-aaaa-bbbb-cccc-" + f"{n}" * 12 for n in "12")
    log = (
        f"[2026-11-27 07:13:27,791: INFO/MainProcess] Task t.x[{a}] received\n"
        f"[2026-11-27 07:13:27,800: INFO/MainProcess] Task t.x[{b}] received\n"
        "[2026-11-27 07:13:30,000: INFO/MainProcess] baton: the store answers again: 2 held "
        "requests handed back to the broker, for every worker to take, in 0.01s; 8 kept "
        f"(this worker's prefetch window is 8): {a}, {b}\n"
    )
    moments = broker_moments(log)
    assert moments[a][1] and moments[b][1]
    assert moments[b][0] - moments[a][0] == 0
