"""The results of a batch's calls on a Redis result backend, judged from outside: the
backend's own command stream (MONITOR), the records a plain task's run leaves beside
them, and callers waiting on pub/sub (issue 37).

The carrier's result is Celery's own (its trace writes it); every other call's result is
written by the pool process that ran the batch, all of them in one pipeline.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import Counter
from datetime import datetime
from typing import Any

import pytest

from tests.batching.test_batching import call_ids, runs_of, settle
from tests.support.monitor import monitored
from tests.support.observer import Observer
from tests.support.servers import StoreServer
from tests.support.waiting import wait_until
from tests.support.workers import Workers

APP = "tests.apps.batching"
RESULTS_DB = 1  # the result backend's db on the broker server (tests/conftest.py)
META = re.compile(r"celery-task-meta-([0-9a-f-]{36})")
#: The commands by which Celery's Redis backend reads or writes a task's record.
RECORD_COMMANDS = {"GET", "MGET", "SET", "SETEX", "PUBLISH"}


def round_trips(commands: list[dict[str, Any]], ids: set[str]) -> tuple[int, Counter]:
    """How many round trips the record commands on the records of ``ids`` took (a
    MULTI...EXEC block is one), and how many of each command there were."""
    trips = 0
    counts: Counter = Counter()
    in_block: dict[str, bool] = {}  # connection -> inside MULTI, and touched
    touched: dict[str, bool] = {}
    for command in commands:
        conn = f"{command['client_address']}:{command['client_port']}"
        name = command["command"].split(" ", 1)[0].upper()
        if name == "MULTI":
            in_block[conn], touched[conn] = True, False
            continue
        if name in ("EXEC", "DISCARD"):
            trips += touched.get(conn, False)
            in_block[conn] = touched[conn] = False
            continue
        if name not in RECORD_COMMANDS:
            continue
        key_ids = set(META.findall(command["command"].split(" ", 2)[1]))
        if name == "MGET":
            key_ids = set(META.findall(command["command"]))
        if not key_ids & ids:
            continue
        counts[name] += 1
        if in_block.get(conn):
            touched[conn] = True
        else:
            trips += 1
    return trips, counts


def test_a_batch_writes_its_calls_results_in_one_pipeline(
    workers: Workers, observer: Observer, broker_server: StoreServer
) -> None:
    from tests.apps.batching import fill

    workers.start(APP, concurrency=2)
    fill.apply_async(kwargs={"account": "warm", "doc": 0}).get(timeout=30)
    n_calls = 8
    with monitored(broker_server, db=RESULTS_DB) as commands:
        results = [fill.apply_async(kwargs={"account": "m", "doc": d}) for d in range(n_calls)]
        runs = [r for r in settle(observer, "fill", n_calls + 1) if r.key == "fill:m"]
        with broker_server.client(RESULTS_DB) as client:
            wait_until(
                lambda: client.exists(*[f"celery-task-meta-{r.id}" for r in results]) == n_calls,
                20,
                "every call's record",
            )
    assert [r.get(timeout=30) for r in results] == [d * 2 for d in range(n_calls)]
    assert sum(len(call_ids(r)) for r in runs) == n_calls
    for run in runs:
        ids = set(call_ids(run))
        trips, counts = round_trips(commands, ids)
        print(f"a batch of {len(ids)}: {trips} round trips on its records, {dict(counts)}")
        writes = counts["SET"] + counts["SETEX"]
        assert writes == len(ids), "each call's record written once"
        assert counts["PUBLISH"] == len(ids), "each call's result published once"
        # The carrier's record is Celery's (a read, then a pipeline); the others' one read
        # and one pipeline together, whatever their number.
        assert trips <= 4, f"{trips} round trips for the results of a batch of {len(ids)}"
    assert any(len(call_ids(r)) >= 4 for r in runs), "the calls ran batched"


def record(server: StoreServer, task_id: str) -> tuple[dict[str, Any], int]:
    """A task's record as the backend holds it (JSON), and its ttl in seconds."""
    with server.client(RESULTS_DB) as client:
        raw = client.get(f"celery-task-meta-{task_id}")
        ttl = int(client.ttl(f"celery-task-meta-{task_id}"))
    assert raw is not None, f"no record for {task_id}"
    return json.loads(raw), ttl


def assert_like(batched: dict[str, Any], plain: dict[str, Any], own: dict[str, Any]) -> None:
    """``batched`` has ``plain``'s fields, each as Celery writes it: the same value, but
    for ``own`` (the call's own values) and a ``date_done`` of the same form."""
    assert sorted(batched) == sorted(plain), "the same fields"
    for name, value in plain.items():
        if name in own:
            assert batched[name] == own[name], f"{name}: {batched[name]!r}"
        elif name == "date_done":
            done, plain_done = (datetime.fromisoformat(v) for v in (batched[name], value))
            assert done.utcoffset() == plain_done.utcoffset(), batched[name]
            assert abs((done - plain_done).total_seconds()) < 60
        elif name == "traceback" and value is not None:
            assert isinstance(batched[name], str) and "ValueError" in batched[name], (
                f"traceback: {batched[name]!r}"
            )
        else:
            assert batched[name] == value, f"{name}: {batched[name]!r}, plainly {value!r}"


@pytest.mark.parametrize("extended", [False, True], ids=["plain", "result_extended"])
def test_a_batched_calls_record_is_the_record_of_a_plain_task(
    workers: Workers, observer: Observer, broker_server: StoreServer, extended: bool
) -> None:
    from tests.apps.batching import boom, double, fill, plain_boom

    workers.start(APP, concurrency=2, env={"BATCH_RESULT_EXTENDED": "1" if extended else ""})
    plain = double.apply_async(kwargs={"account": "r", "doc": 5})
    assert plain.get(timeout=30) == 10
    batched = [fill.apply_async(kwargs={"account": "r", "doc": d}) for d in range(4)]
    assert [r.get(timeout=30) for r in batched] == [0, 2, 4, 6]
    runs = [r for r in runs_of(observer, "fill") if r.key == "fill:r"]
    assert any(len(call_ids(r)) > 2 for r in runs), "the calls ran batched"
    plain_record, plain_ttl = record(broker_server, plain.id)
    print("a plain task's record:", plain_record, plain_ttl)
    for doc, result in enumerate(batched):
        found, ttl = record(broker_server, result.id)
        own: dict[str, Any] = {"task_id": result.id, "result": doc * 2}
        if extended:
            own.update(name=fill.name, kwargs={"account": "r", "doc": doc})
        assert_like(found, plain_record, own)
        assert abs(ttl - plain_ttl) <= 60, f"ttl {ttl}, plainly {plain_ttl}"

    failed = plain_boom.apply_async(kwargs={"account": "f", "fail": True})
    with pytest.raises(ValueError):
        failed.get(timeout=30)
    failing = [boom.apply_async(kwargs={"account": "f", "fail": n == 1}) for n in range(4)]
    for result in failing:
        with pytest.raises(ValueError, match="boom in a batch of 4"):
            result.get(timeout=30)
    plain_failure, plain_ttl = record(broker_server, failed.id)
    print("a plain task's failure:", plain_failure, plain_ttl)
    for n, result in enumerate(failing):
        found, ttl = record(broker_server, result.id)
        own = {"task_id": result.id}
        if extended:
            own.update(name=boom.name, kwargs={"account": "f", "fail": n == 1})
        assert_like(found, plain_failure, own)
        assert abs(ttl - plain_ttl) <= 60, f"ttl {ttl}, plainly {plain_ttl}"


def test_a_caller_waiting_before_its_batch_runs_wakes_on_its_result(
    workers: Workers, observer: Observer
) -> None:
    from tests.apps.batching import slow_fill

    workers.start(APP, concurrency=2)
    slow_fill.apply_async(kwargs={"account": "warm", "doc": 0}).get(timeout=30)
    results = [slow_fill.apply_async(kwargs={"account": "p", "doc": d}) for d in range(5)]
    woke: dict[str, tuple[float, Any]] = {}

    def wait(result: Any) -> None:
        value = result.get(timeout=30)
        woke[result.id] = (time.time(), value)

    # Each caller waits from before its batch runs (batch_wait 2 s): only the result's
    # pub/sub message can wake it (Celery's Redis backend polls no record while waiting).
    waiters = [threading.Thread(target=wait, args=(r,)) for r in results]
    for waiter in waiters:
        waiter.start()
    for waiter in waiters:
        waiter.join(40)
    assert sorted(woke) == sorted(r.id for r in results), "every caller woke"
    assert [woke[r.id][1] for r in results] == [d * 2 for d in range(5)]
    (run,) = [r for r in runs_of(observer, "slow_fill") if r.key == "slow_fill:p"]
    lags = sorted(at - run.end / 1e6 for at, _ in woke.values())
    print(f"callers woke {lags[0]:.3f}-{lags[-1]:.3f} s after their batch's body ended")
    assert lags[-1] < 2.0, "a waiting caller wakes on its result's message"


def test_a_groups_batched_calls_records_name_their_group(
    workers: Workers, observer: Observer, broker_server: StoreServer
) -> None:
    from celery import group

    from tests.apps.batching import double, fill

    workers.start(APP, concurrency=2)
    plain = group(double.s(account="g", doc=d) for d in range(2)).apply_async()
    assert plain.get(timeout=30) == [0, 2]
    batched = group(fill.s(account="g", doc=d) for d in range(6)).apply_async()
    assert batched.get(timeout=30) == [2 * d for d in range(6)]
    runs = [r for r in runs_of(observer, "fill") if r.key == "fill:g"]
    assert any(len(call_ids(r)) > 2 for r in runs), "the group's calls ran batched"
    plain_record, _ = record(broker_server, plain.results[0].id)
    assert plain_record["group_id"] == plain.id
    for doc, result in enumerate(batched.results):
        found, _ = record(broker_server, result.id)
        own = {"task_id": result.id, "result": doc * 2, "group_id": batched.id}
        assert_like(found, plain_record, own)
