"""``baton.cancel`` on the paths beside the common one (issue 38 §2): a debounced task
that asks nothing more (no gate call to check a cancel in), a call cancelled while its
pool process stood still, and ``terminate=True``."""

from __future__ import annotations

import os
import signal
import time
import uuid

import psutil
import pytest
import redis
from celery import states
from celery.exceptions import TaskRevokedError

from tests.support.observer import Observer
from tests.support.pools import ALL_POOLS, POOLS_AND_RECYCLED, pool_setting
from tests.support.task_events import EventCapture
from tests.support.waiting import wait_until
from tests.support.workers import Workers

APP = "tests.apps.cancel"


def test_a_cancelled_debounced_call_never_runs(workers: Workers, observer: Observer) -> None:
    from tests.apps import cancel

    gone = cancel.debounced.delay("a")
    cancel.baton.cancel(gone.id)
    kept = cancel.debounced.delay("b")
    # Started after the cancel: no notice, so the store says it (no gate call to ask).
    workers.start(APP, concurrency=2)
    assert kept.get(timeout=30) == "b"
    assert gone.state == states.REVOKED
    observer.wait_for(1, timeout=10)
    assert {s["task_id"] for s in observer.started()} == {kept.id}


@pytest.mark.parametrize("by", ["id", "key"])
@pytest.mark.parametrize("task", ["limited", "exclusive"])
def test_a_call_cancelled_while_its_pool_process_stood_still_never_starts(
    workers: Workers, observer: Observer, task: str, by: str
) -> None:
    """A call granted and handed to a pool process that stands still (SIGSTOP: one
    swapped out or starved on a loaded machine) is cancelled meanwhile. When the process
    goes on, seconds after the cancel reached the store, the body must not start: the
    promise is judged at the body's start. (It did: the pool process took the stale
    rate grant's fresh token, or nothing, and started the body, cancel unseen.) A rate
    grant (``limited``) and a lease (``exclusive``)."""
    from tests.apps import cancel

    work = getattr(cancel, task)

    worker = workers.start(APP, concurrency=1, env={"TEST_BATON_DEBUG": "1"})
    (child,) = worker.pool_pids()
    os.kill(child, signal.SIGSTOP)
    try:
        call = work.delay(1)
        wait_until(
            lambda: f"[{call.id}] to the pool" in worker.log_text(), 30, "the call handed over"
        )
        if by == "id":
            cancel.baton.cancel(call.id)
        else:
            cancel.baton.cancel(task=work, key={"n": 1})
        time.sleep(3)  # not a wait: the process stands still past the hand-over's margin
    finally:
        os.kill(child, signal.SIGCONT)
    with pytest.raises(TaskRevokedError):
        call.get(timeout=30)
    after = work.delay(2)  # the process goes on with the next call
    assert after.get(timeout=30) == 2
    assert [s["task_id"] for s in observer.started()] == [after.id]
    assert f"[{call.id}] cancelled (cancelled by {by}, before its late start)" in worker.log_text()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mailbox", ["remote-control", "no-remote-control"])
def test_terminate_by_key_stops_the_running_calls_of_the_key(
    mailbox: str, workers: Workers, observer: Observer
) -> None:
    """A cancel by key with ``terminate=True`` stops the running calls of the key, and
    only those: on workers with remote control (found by ``inspect active``), and on
    workers without it (told the key on the store's notice channel; they match it
    against the calls they run)."""
    from tests.apps import cancel

    remote = "1" if mailbox == "remote-control" else "0"
    worker = workers.start(APP, concurrency=2, env={"CANCEL_REMOTE_CONTROL": remote})
    doomed = cancel.slow_keyed.delay(7, 60)
    spared = cancel.slow_keyed.delay(8, 6)
    observer.starts_of("slow:7")
    observer.starts_of("slow:8")
    cancel.baton.cancel(task=cancel.slow_keyed, key={"account_id": 7}, terminate=True)
    wait_until(lambda: "Terminating" in worker.log_text(), 15, "the running body terminated")
    (stopped,) = observer.runs_of("slow:7", timeout=15)
    assert stopped.end - stopped.start < 30_000_000, "the cancelled call ran its 60 s"
    # Stored by the worker as its pool reports the run terminated.
    wait_until(lambda: doomed.state == states.REVOKED, 15, "the terminated call REVOKED")
    assert spared.get(timeout=30) == 6, "a running call of another key was stopped"


@pytest.mark.parametrize(
    ("mailbox", "pool"),
    [
        ("remote-control", "prefork"),
        ("no-remote-control", "prefork"),
        ("no-remote-control", "gevent"),
    ],
)
def test_terminate_stops_a_running_body_and_its_id_never_runs_again(
    mailbox: str, pool: str, workers: Workers, observer: Observer
) -> None:
    """``no-remote-control``: a worker with ``worker_enable_remote_control=False`` hears
    no revoke broadcast; it is told on the store's notice channel (before: the body ran
    its 60 s). On the pools that can stop a body (Celery cannot on threads and solo)."""
    from tests.apps import cancel

    remote = "1" if mailbox == "remote-control" else "0"
    worker = workers.start(APP, pool=pool, concurrency=2, env={"CANCEL_REMOTE_CONTROL": remote})
    running = cancel.slow.delay(60)
    observer.starts_of("slow")
    done = cancel.baton.cancel(running.id, terminate=True)
    assert done.terminated == (running.id,)
    wait_until(lambda: "Terminating" in worker.log_text(), 15, "the running body terminated")
    assert running.state == states.REVOKED
    # Stopped: its 60 s body ended (its SIGTERM ran the observer's finally) at once.
    assert all(run.end - run.start < 30_000_000 for run in observer.runs())
    again = cancel.slow.apply_async((0,), task_id=running.id)  # the same id, sent again
    marker = cancel.keyed.delay(0, 0)
    marker.get(timeout=30)
    time.sleep(1)  # not a wait: a copy that would run runs now
    assert [s["task_id"] for s in observer.started()].count(again.id) == 1  # the first run
    assert again.state == states.REVOKED


def test_a_dropped_cancelled_call_sends_the_task_revoked_event_and_get_raises(
    workers: Workers, observer: Observer, broker_url: str
) -> None:
    """What Flower and ``celery events`` see, and what a caller's ``get()`` does."""
    from tests.apps import cancel

    gone = cancel.keyed.delay(1, 0)
    cancel.baton.cancel(gone.id)
    with pytest.raises(TaskRevokedError):
        gone.get(timeout=10)
    with EventCapture(broker_url) as events:
        workers.start(APP, concurrency=1, extra_args=["-E"])
        event = events.wait_for("task-revoked", gone.id)
    assert event["terminated"] is False
    assert observer.started() == []


@pytest.mark.parametrize("pool", ALL_POOLS)
def test_a_plain_call_waiting_for_a_busy_pool_never_starts_once_cancelled(
    workers: Workers, observer: Observer, pool: str
) -> None:
    """A plain call (no gate call) received while every pool process is busy waits in
    the worker for one (prefork's outbound buffer, the threads pool's queue, a green
    pool's spawn); cancelled meanwhile, it must not start when the pool frees. It was
    screened at its delivery, before its cancel existed: the promise is judged at the
    body's start ("wherever its message is: ... held in a worker"). It started on every
    pool but solo (whose loop reads the call only once the pool is free)."""
    from tests.apps import cancel

    worker = workers.start(APP, pool=pool, concurrency=1)
    busy = cancel.slow.delay(4.0)
    wait_until(lambda: any(s["task_id"] == busy.id for s in observer.started()), 30, "busy")
    call = cancel.keyed.delay(7, 1)
    if pool == "solo":
        # Solo's loop stands still while the body runs: the call is read after it (and
        # then starts at once); cancelled while it is still in the broker.
        time.sleep(0.5)
    else:
        wait_until(lambda: call.id in worker.log_text(), 30, "the call received")
    cancel.baton.cancel(call.id)
    assert busy.get(timeout=30) == 4.0
    with pytest.raises(TaskRevokedError):
        call.get(timeout=30)
    after = cancel.keyed.delay(7, 2)  # the pool goes on with the next call
    assert after.get(timeout=30) == 2
    started = [s["task_id"] for s in observer.started()]
    assert call.id not in started, f"the cancelled call started ({pool})"
    assert started == [busy.id, after.id]


@pytest.mark.parametrize("pool", POOLS_AND_RECYCLED)
def test_a_plain_call_waiting_for_a_busy_pool_never_starts_once_cancelled_by_key(
    workers: Workers, observer: Observer, pool: str
) -> None:
    """The same wait, cancelled by key: a plain call of account 7 received while the
    only pool process is busy, then ``baton.cancel(task=keyed, key={"account_id": 7})``.
    It was matched against the task's key cancels at its receipt, before this one
    existed; it must not start when the pool frees, its result REVOKED, while a waiting
    call of another account runs. Recycled (``--max-tasks-per-child 2``): the busy call
    is its process's last, so the cancelled call reaches a process forked after the
    cancel."""
    from tests.apps import cancel

    name, *extra = pool.split()
    worker = workers.start(APP, pool=name, concurrency=1, extra_args=extra)
    warm = cancel.keyed.delay(8, 0)
    assert warm.get(timeout=30) == 0
    # Autoscaled, the pool grows for a waiting call: as many busy calls as it may have
    # processes (with one, the autoscaler added a process and the call started at once,
    # before the cancel: a CI rehearsal, 2026-12-01).
    most = int(extra[1].split(",")[0]) if extra[:1] == ["--autoscale"] else 1
    slow = [cancel.slow.delay(4.0) for _ in range(most)]
    busy = slow[0]
    wait_until(
        lambda: {s["task_id"] for s in observer.started()} >= {r.id for r in slow}, 30, "busy"
    )
    call = cancel.keyed.delay(7, 1)
    other = cancel.keyed.delay(8, 3)
    if name == "solo":
        time.sleep(0.5)  # solo's loop reads the calls only after the busy body
    else:
        # (A green pool of one prefetches one call: ``other`` waits in the broker.)
        wait_until(lambda: call.id in worker.log_text(), 30, "the call received")
    cancel.baton.cancel(task=cancel.keyed, key={"account_id": 7})
    assert busy.get(timeout=30) == 4.0
    with pytest.raises(TaskRevokedError):
        call.get(timeout=30)
    assert call.state == states.REVOKED
    assert other.get(timeout=30) == 3
    after = cancel.keyed.delay(7, 2)  # published after the cancel: it runs
    assert after.get(timeout=30) == 2
    started = [s["task_id"] for s in observer.started()]
    assert call.id not in started, f"the call cancelled by key started ({pool})"
    assert sorted(started) == sorted([warm.id, *(r.id for r in slow), other.id, after.id])


#: The pools where a plain call waits in the worker for a busy pool (solo reads the next
#: call only after the body it runs).
WAITING_POOLS = [pool for pool in ALL_POOLS if pool != "solo"]


@pytest.mark.parametrize("by", ["id", "key"])
@pytest.mark.parametrize("pool", WAITING_POOLS)
def test_a_plain_call_cancelled_while_it_waited_for_its_pool_sends_task_revoked(
    workers: Workers, observer: Observer, broker_url: str, pool: str, by: str
) -> None:
    """What Flower and ``celery events`` see of a plain call cancelled while it waited
    for a busy pool: Celery's own ``task-revoked`` event (not terminated, no signal, not
    expired), as for a call dropped at its receipt. None was sent on that path."""
    from tests.apps import cancel

    with EventCapture(broker_url) as events:
        worker = workers.start(APP, pool=pool, concurrency=1, extra_args=["-E"])
        busy = cancel.slow.delay(3.0)
        wait_until(lambda: any(s["task_id"] == busy.id for s in observer.started()), 30, "busy")
        call = cancel.keyed.delay(7, 1)
        wait_until(lambda: call.id in worker.log_text(), 30, "the call received")
        if by == "id":
            cancel.baton.cancel(call.id)
        else:
            cancel.baton.cancel(task=cancel.keyed, key={"account_id": 7})
        assert busy.get(timeout=30) == 3.0
        with pytest.raises(TaskRevokedError):
            call.get(timeout=30)
        event = events.wait_for("task-revoked", call.id)
    assert (event["terminated"], event["signum"], event["expired"]) == (False, None, False)
    # Celery reports the job's accept (task-started) before the judgement at its start.
    assert events.types(call.id) == ["task-received", "task-started", "task-revoked"]
    assert call.id not in [s["task_id"] for s in observer.started()]


@pytest.mark.parametrize("by", ["id", "key"])
@pytest.mark.parametrize("pool", WAITING_POOLS)
def test_a_plain_call_whose_worker_stood_still_and_missed_its_cancel_never_starts(
    workers: Workers, observer: Observer, store_url: str, pool: str, by: str
) -> None:
    """A plain call screened, then waiting for a busy pool; the whole worker stands
    still (SIGSTOP) and its notice connection is dropped meanwhile (the server's
    ``CLIENT KILL``: a restart, a failover, a pubsub client over its output buffer
    limit), and the call is cancelled: the worker never hears of it. When it goes on,
    the call must not start: a worker that has not heard the notice channel lately asks
    the store where a plain job starts. It started on every pool before (a plain job was
    judged from the notices heard only)."""
    from tests.apps import cancel

    worker = workers.start(APP, pool=pool, concurrency=1)
    busy = cancel.slow.delay(3.0)
    wait_until(lambda: any(s["task_id"] == busy.id for s in observer.started()), 30, "busy")
    call = cancel.keyed.delay(7, 1)
    wait_until(lambda: call.id in worker.log_text(), 30, "the call received")
    time.sleep(0.3)  # not a wait: its screening, moments after its receipt
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        store = redis.Redis.from_url(store_url)
        assert store.client_kill_filter(_type="pubsub") >= 1  # its notice connection
        if by == "id":
            cancel.baton.cancel(call.id)
        else:
            cancel.baton.cancel(task=cancel.keyed, key={"account_id": 7})
        time.sleep(3.0)  # not a wait: the worker stands still past the busy body's end
    finally:
        os.kill(worker.pid, signal.SIGCONT)
    assert busy.get(timeout=30) == 3.0
    with pytest.raises(TaskRevokedError):
        call.get(timeout=30)
    after = cancel.keyed.delay(8, 2)  # the pool goes on with the next call
    assert after.get(timeout=30) == 2
    started = [s["task_id"] for s in observer.started()]
    assert call.id not in started, f"the plain call cancelled by {by} started ({pool})"


@pytest.mark.parametrize("by", ["id", "key"])
@pytest.mark.parametrize("task", ["limited", "exclusive"])
@pytest.mark.parametrize("pool", ALL_POOLS)
def test_a_call_cancelled_while_its_worker_stood_still_at_the_hand_over_never_starts(
    workers: Workers, observer: Observer, pool: str, task: str, by: str
) -> None:
    """The whole worker stands still (SIGSTOP: swapped out, starved on a loaded machine)
    just as it hands a granted call to its pool (the test app stops it as it logs the
    call's "to the pool"), and the call is cancelled meanwhile. When the worker goes on,
    seconds after the cancel reached the store, the body must not start, on every pool:
    the promise is judged at the body's start. It started on the threads pool (its
    thread took a stale rate grant's fresh token but never asked about a cancel; found
    by the nemesis soak, seed 695513179) and on solo (the body ran as it was handed
    over). A rate grant (``limited``) and a lease (``exclusive``); cancelled by id, or
    by a key of its arguments (which the worker, stopped, had not matched: the late job
    asks the store about its task's key cancels too; before, it started on any pool
    when the job ran before the worker read the cancel's notice)."""
    _cancel_while_the_worker_stands_still(workers, observer, task, by, pool)


#: The settings production workers run, at the same stood-still hand-over: processes
#: recycled after every run (the job goes to one forked while the worker stood still),
#: grown and shrunk by ``--autoscale``, time limits (the run's start judged inside them),
#: and ``acks_late`` (the message acked only after the judgement's revoke).
STOOD_STILL_SETTINGS = [
    pytest.param("prefork --max-tasks-per-child 1", {}, id="prefork-recycled"),
    pytest.param("prefork --autoscale 3,1", {}, id="prefork-autoscale"),
    pytest.param("prefork --time-limit 30 --soft-time-limit 20", {}, id="prefork-time-limits"),
    pytest.param("prefork", {"TEST_ACKS_LATE": "1"}, id="prefork-acks-late"),
    pytest.param("threads", {"TEST_ACKS_LATE": "1"}, id="threads-acks-late"),
    pytest.param("gevent --time-limit 30 --soft-time-limit 20", {}, id="gevent-time-limits"),
]


@pytest.mark.parametrize(("task", "by"), [("limited", "id"), ("exclusive", "key")])
@pytest.mark.parametrize(("pool", "env"), STOOD_STILL_SETTINGS)
def test_a_call_cancelled_while_its_worker_stood_still_never_starts_on_every_setting(
    workers: Workers, observer: Observer, pool: str, env: dict[str, str], task: str, by: str
) -> None:
    """The stood-still hand-over above, with the settings production workers run: the
    judgement at the body's start holds whichever process takes the job and whatever
    acknowledges it."""
    _cancel_while_the_worker_stands_still(workers, observer, task, by, pool, env)


def _cancel_while_the_worker_stands_still(
    workers: Workers,
    observer: Observer,
    task: str,
    by: str,
    pool: str,
    env: dict[str, str] | None = None,
) -> None:
    from tests.apps import cancel

    work = getattr(cancel, task)
    call_id = str(uuid.uuid4())
    name, extra, pool_env = pool_setting(pool)
    worker = workers.start(
        APP,
        pool=name,
        concurrency=1,
        extra_args=extra,
        env={**pool_env, **(env or {}), "TEST_STOP_AT_LINE": f"[{call_id}] to the pool"},
    )
    assert work.delay(0).get(timeout=30) == 0  # the pool is up
    call = work.apply_async((1,), task_id=call_id)
    process = psutil.Process(worker.pid)
    wait_until(
        lambda: process.status() == psutil.STATUS_STOPPED, 30, "the worker stopped at the hand-over"
    )
    try:
        if by == "id":
            cancel.baton.cancel(call.id)
        else:
            cancel.baton.cancel(task=work, key={"n": 1})
        time.sleep(1.0)  # not a wait: the worker stands still past the hand-over's margin
    finally:
        os.kill(worker.pid, signal.SIGCONT)
    with pytest.raises(TaskRevokedError):
        call.get(timeout=30)
    after = work.delay(2)  # the pool goes on with the next call
    assert after.get(timeout=30) == 2
    started = [s["task_id"] for s in observer.started()]
    assert call.id not in started, f"the call cancelled by {by} started ({pool})"
