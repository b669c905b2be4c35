"""A publish made after the caller saw the result is a new run (issue 35.5).

``r.get(); f.delay(k)``: the caller saw the run end, so the key must be free. It was
freed after the result was stored (by the pool process in ``task_postrun``, or by the
main process after the ack), and 16-27 % of such publishes were deduplicated into the
finished task: the caller got its id back, and no new run. The claim is now freed
before the result is stored.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import time
from typing import Any

import pytest
import redis
from billiard.exceptions import WorkerLostError
from celery import Celery
from celery.exceptions import TimeLimitExceeded

from celery_baton import Baton
from tests.support.celery_processes import _process_env
from tests.support.pools import TIME_LIMIT_POOLS, pool_setting
from tests.support.processes import REPO_ROOT
from tests.support.servers import StoreServer
from tests.support.waiting import revoke_until_heard, wait_until
from tests.support.workers import Workers

APP = "tests.apps.run_ends"
TRIES = 200


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("task_name", "pool"),
    [
        ("uq_quick", "prefork"),
        ("uq_quick_guarded", "prefork"),
        ("uq_quick_late", "prefork"),
        # The task runs in the main process: its end is recorded there, before the result.
        ("uq_quick", "solo"),
        ("uq_quick_late", "threads"),
    ],
)
def test_a_publish_after_get_returned_is_a_new_run(
    workers: Workers, task_name: str, pool: str
) -> None:
    from tests.apps import run_ends

    task = getattr(run_ends, task_name)
    workers.start(APP, concurrency=2, pool=pool)
    previous = task.delay("k")
    assert previous.get(timeout=60) == previous.id
    deduplicated = 0
    for _ in range(TRIES):
        result = task.delay("k")
        if result.id == previous.id:
            deduplicated += 1
            time.sleep(0.1)  # one late free counted once, not once per publish meanwhile
            continue
        assert result.get(timeout=20) == result.id
        previous = result
    assert deduplicated == 0, f"{deduplicated} of {TRIES} publishes got the finished task"


FAILED_TRIES = 12


def _publishes_after_the_failure(
    workers: Workers, pool: str, task: Any, failure: type[BaseException]
) -> None:
    """``FAILED_TRIES`` keys: a publish whose run ends in ``failure``, seen by the caller,
    then a publish of the same key, which must be a new task."""
    name, extra, env = pool_setting(pool)
    workers.start(APP, concurrency=2, pool=name, extra_args=extra, env=env)
    deduplicated = 0
    for n in range(FAILED_TRIES):
        first = task.delay(f"k{n}")
        with pytest.raises(failure):
            first.get(timeout=60)
        if task.delay(f"k{n}").id == first.id:
            deduplicated += 1
    assert deduplicated == 0, (
        f"{deduplicated} of {FAILED_TRIES} publishes after the failure got the failed task"
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("pool", TIME_LIMIT_POOLS)
def test_a_publish_after_a_time_limit_failure_was_seen_is_a_new_run(
    workers: Workers, pool: str
) -> None:
    """A run past its hard time limit ends in the main process: Celery kills its process
    (unwinds its greenlet) and stores its FAILURE there. The caller who saw that failure
    publishes again: a new run, not the failed task's id."""
    from tests.apps import run_ends

    _publishes_after_the_failure(workers, pool, run_ends.uq_past_its_time_limit, TimeLimitExceeded)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "pool",
    [
        "prefork",
        pytest.param("prefork --max-tasks-per-child 1", id="prefork-recycled"),
        pytest.param("prefork --autoscale 3,1", id="prefork-autoscale"),
    ],
)
def test_a_publish_after_a_lost_process_failure_was_seen_is_a_new_run(
    workers: Workers, pool: str
) -> None:
    """A run whose pool process died (``WorkerLostError``) ends in the main process too,
    which stores its FAILURE: a publish after the caller saw it is a new run."""
    from tests.apps import run_ends

    _publishes_after_the_failure(workers, pool, run_ends.uq_process_killed, WorkerLostError)


def _until_a_worker_holds(store_url: str, task_id: str) -> None:
    """Until a worker holds ``task_id`` for its countdown (a revoke sent before the
    message reached a worker frees its key only when a worker discards it: the unique
    guide): read from the mark that worker writes under the id (worker/cancelling.py),
    on every Celery (``inspect`` lists a task waiting for its ETA in ``query_task`` only
    since 5.6, and on 5.3 its replies came too late for a 3 s countdown)."""
    from tests.apps.run_ends import baton

    mark = baton.names.held_for_later(task_id)
    store = redis.Redis.from_url(store_url)
    deadline = time.monotonic() + 30
    while not store.exists(mark):
        assert time.monotonic() < deadline, f"{task_id}: no worker holds it after 30 s"
        time.sleep(0.01)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("pool", "how"),
    [
        ("prefork", "countdown"),
        ("prefork", "expires"),
        ("gevent", "countdown"),
        ("threads", "countdown"),
        ("solo", "countdown"),
    ],
)
def test_a_publish_after_a_revoke_before_the_start_was_seen_is_a_new_run(
    workers: Workers, store_url: str, pool: str, how: str
) -> None:
    """A task revoked before its start: revoked while its countdown runs (Celery 5.6 and
    later store REVOKED as the worker hears the revoke), or expired before a pool process
    could take it (Celery's main process stores REVOKED as it discards the message). A
    caller who sees REVOKED and publishes again gets a new run, not the revoked task's
    id. (With several workers, every one that hears the revoke stores REVOKED, the
    holder perhaps a moment after another: a two-worker run of this test caught it once
    under load; the unique guide says it.)"""
    from tests.apps import run_ends

    workers.start(APP, concurrency=1, pool=pool)
    deduplicated = 0
    for n in range(FAILED_TRIES):
        key = f"r{n}"
        if how == "countdown":
            first = run_ends.uq_quick.apply_async((key,), countdown=3)
            _until_a_worker_holds(store_url, first.id)
            # Until a worker answers: a revoke sent before its control consumer listens
            # is lost (a loaded CI rehearsal's gevent worker never heard it, and ran r0).
            revoke_until_heard(run_ends.app, first.id, terminate=False)
        else:  # behind a run of 1 s on the worker's only process, expired when it frees
            run_ends.sleeper.delay(1.0)
            first = run_ends.uq_quick.apply_async((key,), expires=0.3)
        deadline = time.monotonic() + 30
        while first.state != "REVOKED":  # the caller looks as often as it can
            assert time.monotonic() < deadline, f"{key}: not revoked in 30 s ({first.state})"
        if run_ends.uq_quick.delay(key).id == first.id:
            deduplicated += 1
    assert deduplicated == 0, (
        f"{deduplicated} of {FAILED_TRIES} publishes after REVOKED got the revoked task"
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("pool", ["prefork", "gevent", "threads", "solo"])
def test_a_publish_after_a_cancel_before_the_start_was_seen_is_a_new_run(
    workers: Workers, store_url: str, pool: str
) -> None:
    """``baton.cancel(task_id)`` of a task waiting in a worker for its countdown: the
    caller marks it REVOKED at once. A publish of its key after that is a new run (the
    key was freed only when the worker discarded the message at its time: 12 of 12 got
    the cancelled task's id), and the cancelled task never runs."""
    from tests.apps import run_ends

    workers.start(APP, concurrency=1, pool=pool)
    deduplicated = 0
    cancelled = []
    for n in range(FAILED_TRIES):
        key = f"c{n}"
        first = run_ends.uq_quick.apply_async((key,), countdown=3)
        _until_a_worker_holds(store_url, first.id)
        run_ends.baton.cancel(first.id)
        assert first.state == "REVOKED"
        cancelled.append(first)
        if run_ends.uq_quick.delay(key).id == first.id:
            deduplicated += 1
    assert deduplicated == 0, (
        f"{deduplicated} of {FAILED_TRIES} publishes after the cancel got the cancelled task"
    )
    time.sleep(4)  # past every countdown: a cancelled task that ran would be SUCCESS now
    ran = [r.id for r in cancelled if r.state != "REVOKED"]
    assert not ran, f"cancelled tasks ran: {ran}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("pool", "by"),
    [("prefork", "id"), ("threads", "id"), ("gevent", "id"), ("prefork", "key")],
)
def test_a_publish_after_a_cancel_of_a_call_in_a_workers_prefetch_is_a_new_run(
    workers: Workers, pool: str, by: str
) -> None:
    """``baton.cancel(task_id)`` (or by key) of a unique call a worker took into its
    prefetch (its one process busy): by id the caller marks it REVOKED at once; a
    publish of its key after the cancel returned is a new run (the key was freed only
    when the worker discarded the message, at its turn in the pool: 3 of 3 got the
    cancelled call's id). The cancelled call never runs; the new one does. Not solo:
    its one thread runs the busy task and hears nothing meanwhile (nor would Celery's
    remote control)."""
    from celery_baton.worker.transport.queued import DELIVERED, queued
    from tests.apps import run_ends

    worker = workers.start(APP, concurrency=1, pool=pool)
    cancelled, published_again = [], []
    for n in range(3):
        busy = run_ends.sleeper.delay(2.0)
        first = run_ends.uq_quick.delay(f"p{n}")
        wait_until(
            lambda: f"[{first.id}] received" in worker.log_text(),  # noqa: B023
            15,
            "the call in the worker's prefetch",
        )
        assert queued(run_ends.app, first.id) == DELIVERED
        if by == "id":
            run_ends.baton.cancel(first.id)
            assert first.state == "REVOKED"
        else:
            run_ends.baton.cancel(task=run_ends.uq_quick, key={"key": f"p{n}"})
        cancelled.append(first)
        published_again.append(run_ends.uq_quick.delay(f"p{n}"))
        busy.get(timeout=30)
    deduplicated = [r.id for r in published_again if r.id in {c.id for c in cancelled}]
    assert not deduplicated, f"publishes after the cancel got the cancelled call: {deduplicated}"
    assert [r.get(timeout=30) for r in published_again] == [r.id for r in published_again]
    wait_until(lambda: all(c.state == "REVOKED" for c in cancelled), 15, "cancelled REVOKED")


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("pool", "by", "app", "compression"),
    [
        ("prefork", "id", APP, None),
        ("threads", "id", APP, None),
        ("prefork", "key", APP, None),
        # kombu's global_keyprefix on the broker's keys: the look finds the message too
        pytest.param("prefork", "id", "tests.apps.keyprefix", None, id="prefork-id-keyprefix"),
        # a compressed body (task_compression, or per call): the look reads it too
        pytest.param("prefork", "id", APP, "gzip", id="prefork-id-gzip"),
        pytest.param("prefork", "key", APP, "bzip2", id="prefork-key-bzip2"),
    ],
)
def test_a_publish_after_a_cancel_of_a_call_waiting_in_the_broker_is_a_new_run(
    workers: Workers, pool: str, by: str, app: str, compression: str | None
) -> None:
    """``baton.cancel(task_id)`` (or ``baton.cancel(task=, key=)``) of a unique call whose
    message still waits in the broker (a busy worker, its prefetch full): a publish of
    its key after the cancel returned is a new run, not the cancelled call's id (it was
    deduplicated into it until a worker discarded the message: 3 of 3). The cancelled
    call never runs; the new one does. (A Redis broker: the cancel finds the message in
    its queue.)"""
    from celery_baton.worker.transport.queued import QUEUED, queued

    run_ends = importlib.import_module(app)
    workers.start(app, concurrency=1, pool=pool)
    busy = [run_ends.sleeper.delay(0.5) for _ in range(12)]  # the pool and the prefetch
    cancelled, published_again = [], []
    for n in range(3):
        key = f"b{n}"
        first = run_ends.uq_quick.apply_async((key,), compression=compression)
        assert queued(run_ends.app, first.id) == QUEUED, "the call did not wait in the broker"
        if by == "id":
            run_ends.baton.cancel(first.id)
            assert first.state == "REVOKED"  # marked by the caller at once
        else:
            run_ends.baton.cancel(task=run_ends.uq_quick, key={"key": key})
        cancelled.append(first)
        published_again.append(run_ends.uq_quick.apply_async((key,), compression=compression))
    deduplicated = [r.id for r in published_again if r.id in {c.id for c in cancelled}]
    assert not deduplicated, f"publishes after the cancel got the cancelled call: {deduplicated}"
    for result in busy:
        result.get(timeout=60)
    assert [r.get(timeout=30) for r in published_again] == [r.id for r in published_again]
    ran = [r.id for r in cancelled if r.state != "REVOKED"]
    assert not ran, f"cancelled calls ran: {ran}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("task_name", ["uq_own_queue", "uq_routed"])
def test_a_cancel_from_a_process_that_never_published_finds_the_call_in_its_queue(
    workers: Workers, task_name: str
) -> None:
    """The call waits in a queue of its task's own (``queue=``, ``task_routes``); the
    cancel is made by another process, which never published the task, so never
    routed a call there (a web process cancelling what a beat or another service
    published): the look must read that queue too. Before, it read the queues its own
    process knew: the publish after the cancel got the cancelled call."""
    run_ends = importlib.import_module(APP)
    task = getattr(run_ends, task_name)
    cancelled, deduplicated = [], []
    for n in range(3):
        first = task.delay(f"q{n}")  # no worker reads its queue: it waits there
        subprocess.run(
            [
                sys.executable,
                "-c",
                f"from {APP} import baton; baton.cancel({first.id!r})",
            ],
            env=_process_env(workers.env),
            cwd=REPO_ROOT,
            check=True,
            timeout=60,
        )
        cancelled.append(first)
        if task.delay(f"q{n}").id == first.id:
            deduplicated.append(n)
    assert not deduplicated, (
        f"{len(deduplicated)} of 3 publishes after the cancel got the cancelled call"
    )
    workers.start(APP, concurrency=1, queues="uq-own-queue,uq-routed")
    for n in range(3):  # the new calls run; the cancelled ones never do
        assert task.delay(f"q{n}").get(timeout=30)
    ran = [r.id for r in cancelled if r.state != "REVOKED"]
    assert not ran, f"cancelled calls ran: {ran}"


@pytest.mark.timeout(120)
def test_a_cancel_while_the_broker_hangs_returns_without_the_look(
    store_url: str, broker_server: StoreServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The cancel looks for a unique call's message in the broker after it wrote the
    cancel; a broker that hangs (SIGSTOP) must not hold the cancel: the look gives up
    (logged), a later cancel does not wait on it again, and the cancel is made. Before
    the look had a bound, ``baton.cancel`` hung until the broker came back (two CI tests
    timed out). An app of the test's own: no result backend on the paused server."""
    app = Celery("hung", broker=broker_server.url(0), set_as_current=False)
    app.conf.update(baton_url=store_url, broker_connection_retry_on_startup=True)
    baton = Baton(app)

    @app.task(shared=False, unique="key")
    def uq_hung(key: str) -> None: ...

    first = uq_hung.delay("hung")  # no worker: it waits in the broker
    broker_server.pause()
    try:
        took = []
        for task_id in (first.id, "never-published"):
            started = time.monotonic()
            baton.cancel(task_id)
            took.append(time.monotonic() - started)
    finally:
        broker_server.resume()
    assert max(took) < 10, f"cancels took {took} s with the broker paused"
    assert "could not look for" in caplog.text
    assert baton.parts.cancels.is_cancelled(first.id)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_a_cancel_of_a_started_countdown_task_leaves_its_key_to_the_run(
    workers: Workers, pool: str
) -> None:
    """A task whose countdown ran out and whose body runs, cancelled (no ``terminate``):
    its body goes on, so its key stays held; a publish of the key meanwhile is
    deduplicated into it. (The mark its worker wrote while it waited, which lets a cancel
    free the key, is taken back as it starts.)"""
    from tests.apps import run_ends

    workers.start(APP, concurrency=1, pool=pool)
    first = run_ends.uq_sleeping.apply_async(("s", 4.0), countdown=1)
    deadline = time.monotonic() + 30
    while not _active(first.id):
        assert time.monotonic() < deadline, "the task did not start within 30 s"
        time.sleep(0.1)
    run_ends.baton.cancel(first.id)
    assert run_ends.uq_sleeping.delay("s", 0.0).id == first.id, "the running task's key was freed"


def _active(task_id: str) -> bool:
    from tests.apps.run_ends import app

    found = app.control.inspect(timeout=0.5).query_task(task_id) or {}
    return any(state == "active" for tasks in found.values() for state, _ in tasks.values())
