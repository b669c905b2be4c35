"""Bad input and a store that goes away, at the worker (issue 2, item 7).

* A key that cannot be built from a delivered message: the task fails with a clear
  ``KeySpecError`` and is not run (never run unguarded).
* The store paused (SIGSTOP: calls time out) or killed (connections refused) while a
  request arrives: with the default ``baton_on_store_error="hold"`` the worker holds it,
  runs nothing unguarded and does not crash; once the store is back the task runs.
"""

from __future__ import annotations

import time

import psutil
import pytest
import redis

from celery_baton import KeySpecError
from tests.support.observer import Observer, assert_no_overlap
from tests.support.servers import StoreServer
from tests.support.waiting import broadcast, wait_until
from tests.support.workers import Workers

APP = "tests.apps.exclusive"


def test_a_key_that_cannot_be_built_fails_the_task_and_it_does_not_run(
    workers: Workers, observer: Observer
) -> None:
    from tests.apps.exclusive import app, ex_by_format, ex_by_function, ex_skip, ex_wait

    worker = workers.start(APP, concurrency=2)
    # NaN travels in a JSON message but is not a canonical key; a wrong arity is caught
    # only by the worker when the task is sent by name. A key function of the app's own
    # that raises, and a template whose format spec does not fit the argument: the
    # worker died of them ("Unrecoverable error: ZeroDivisionError"), and again at every
    # restart, the message being given back each time.
    bad = [
        ex_skip.delay(float("nan")),
        ex_wait.delay(float("nan"), 0),
        app.send_task("tests.apps.exclusive.ex_skip", args=["k", 0, "extra"]),
        ex_by_function.delay("k", 0),
        ex_by_format.delay("k", "abc"),
    ]
    for result in bad:
        with pytest.raises(KeySpecError) as error:
            result.get(timeout=20)
        assert "tests.apps.exclusive.ex_" in str(error.value)
        assert result.state == "FAILURE"
    assert ex_skip.delay("good").get(timeout=20)  # the worker goes on
    assert [r.key for r in observer.runs()] == ["good"]
    log = worker.log_text()
    assert all(f"[{result.id}] refused" in log for result in bad)
    assert worker.is_running


@pytest.mark.parametrize("outage", ["pause", "kill"])
def test_store_down_at_the_worker_holds_the_request_until_it_is_back(
    outage: str, workers: Workers, observer: Observer, store_server: StoreServer
) -> None:
    from tests.apps.exclusive import ex_wait

    worker = workers.start(APP, concurrency=2)
    assert ex_wait.delay("warm", 0).get(timeout=20)  # connected to the store
    getattr(store_server, outage)()
    try:
        results = [ex_wait.delay("outage", 0.2) for _ in range(3)]
        wait_until(
            lambda: worker.log_text().count("store unavailable, holding") >= 2,
            30,
            "worker holds the requests",
        )
        time.sleep(1.0)  # a request let through while the store is down would start now
        assert [s for s in observer.started() if s["key"] == "outage"] == []
        assert worker.is_running
        assert all(result.state == "PENDING" for result in results)
    finally:
        store_server.resume()
        store_server.start()

    for result in results:
        assert result.get(timeout=30)  # backoff is capped at 10 s
    runs = [r for r in observer.runs() if r.key == "outage"]
    assert len(runs) == 3
    assert_no_overlap(runs)
    assert worker.is_running
    assert "Traceback" not in worker.log_text()
    assert ex_wait.delay("after", 0).get(timeout=20)


def test_store_down_with_run_policy_runs_unguarded_and_says_so(
    workers: Workers, observer: Observer, store_server: StoreServer
) -> None:
    """``baton_on_store_error="run"`` fails open: the task runs without its lease, and
    every such run is logged as UNGUARDED."""
    from tests.apps.exclusive import ex_unfenced

    worker = workers.start(APP, concurrency=2, env={"BATON_TEST_ON_STORE_ERROR": "run"})
    assert ex_unfenced.delay("warm").get(timeout=20)
    store_server.kill()
    try:
        results = [ex_unfenced.delay("open") for _ in range(3)]
        for result in results:
            assert result.get(timeout=30)
        assert len([r for r in observer.runs() if r.key == "open"]) == 3
        assert worker.log_text().count("UNGUARDED") >= 3
        assert worker.is_running
    finally:
        store_server.start()


def test_scripts_flushed_mid_run_are_loaded_again(
    workers: Workers, observer: Observer, store_server: StoreServer
) -> None:
    """SCRIPT FLUSH while a worker has gate calls in flight: every call is answered in
    order, the script is loaded again, and every task runs once."""
    from tests.apps.exclusive import ex_wait

    workers.start(APP, concurrency=2)
    assert ex_wait.delay("warm", 0).get(timeout=20)
    with store_server.client() as store:
        store.script_flush()
    results = [ex_wait.delay(f"flush-{i % 5}", 0) for i in range(40)]
    for result in results:
        assert result.get(timeout=30)
    runs = [r for r in observer.runs() if r.key.startswith("flush-")]
    assert len(runs) == 40
    assert_no_overlap(runs)


def test_guarded_tasks_keep_running_after_the_broker_connection_comes_back(
    workers: Workers, observer: Observer, broker_server: StoreServer
) -> None:
    """A broker outage makes Celery reset the worker's event loop (every registered
    file descriptor and the connection's timers are dropped) and restart the consumer.
    The store channel and the release-notice wake-ups must come back with it."""
    from tests.apps.exclusive import ex_wait

    worker = workers.start(APP, concurrency=2)
    assert ex_wait.delay("before", 0).get(timeout=20)
    broker_server.restart(down_for=1.0)
    wait_until(
        lambda: worker.log_text().count("Connected to redis://") >= 2,
        60,
        "the worker reconnects to the broker",
    )
    results = [ex_wait.delay(f"after-{i % 2}", 0.1) for i in range(6)]
    # Timed from the last publish: before Celery 5.6 this test's own client may take
    # a minute to publish again after the restart (its result backend reconnecting),
    # which says nothing of the worker.
    started = time.monotonic()
    for result in results:
        assert result.get(timeout=60)
    # Same-key runs waited for each other's release (a notice or a retry), not long.
    assert time.monotonic() - started < 30
    runs = [r for r in observer.runs() if r.key.startswith("after-")]
    assert len(runs) == 6
    assert_no_overlap(runs)
    assert worker.is_running


def test_a_request_admitted_while_the_pool_was_full_frees_its_key_when_the_connection_drops(
    workers: Workers, observer: Observer, broker_server: StoreServer
) -> None:
    """A request the gate admitted waits for a pool slot in Celery's semaphore; when the
    broker connection drops, Celery clears that queue (its message comes back from the
    broker) and never calls the request again. Its lease must be given back: held (and
    renewed) by a request that will never run, it kept the key for the worker's life,
    and every later run of the key waited for ever."""
    from tests.apps.exclusive import ex_wait

    worker = workers.start(APP, concurrency=1)
    busy = ex_wait.delay("busy", 4.0)
    wait_until(lambda: observer.running("busy") == 1, 20, "the pool's only process to be busy")
    queued = ex_wait.delay("queued", 0)
    wait_until(lambda: f"[{queued.id}] received" in worker.log_text(), 20, "the second request")
    time.sleep(0.5)  # admitted by the gate; waiting for the pool
    broker_server.restart(down_for=1.0)
    wait_until(
        lambda: worker.log_text().count("Connected to redis://") >= 2,
        60,
        "the worker reconnects to the broker",
    )
    assert busy.get(timeout=30)
    later = ex_wait.delay("queued", 0)
    assert later.get(timeout=45), "the key stayed with a request that will never run"
    assert worker.is_running


def test_a_worker_holding_a_request_lives_through_a_broker_crash(
    workers: Workers, observer: Observer, broker_server: StoreServer
) -> None:
    """A worker whose broker is SIGKILLed while it polls with an unacked message in hand
    (here a request held for a busy key) died: ``Unrecoverable error:
    AttributeError("'NoneType' object has no attribute 'hostname'")``, exit 1, in kombu's
    interrupted channel close (worker/transport/broker_close.py says how). The worker lives on and
    runs the key again. The held message, which the dead broker could not take back, is
    kept once the worker reconnects (worker/transport/held_return.py), and runs:
    before, it stayed in the broker's unacked index for the visibility timeout (an hour
    in this app)."""
    from tests.apps.exclusive import ex_wait

    worker = workers.start(APP, concurrency=2)
    # Long enough that the second is still held when the worker reconnects (with 4 s, a
    # loaded machine's reconnect came after the first ended and the second ran).
    ex_wait.delay("broker-crash", 10.0)
    wait_until(lambda: observer.running("broker-crash") == 1, 20, "the first run")
    second = ex_wait.delay("broker-crash", 0)
    wait_until(lambda: f"[{second.id}] held for" in worker.log_text(), 20, "the second held")
    broker_server.restart(kill=True, down_for=1.0)
    wait_until(
        lambda: not worker.is_running or worker.log_text().count("Connected to redis://") >= 2,
        60,
        "the worker to reconnect to the broker (or die)",
    )
    assert worker.is_running, f"the worker died:\n{worker.log_text()[-2500:]}"
    assert "Unrecoverable error" not in worker.log_text()
    assert "1 held requests left to the broker" in worker.log_text()
    runs = observer.runs_of("broker-crash", 2, timeout=45)  # the first, and the held one
    assert second.id in {run.task_id for run in runs}
    # Kept: taken into the new channel, never through its queue (a put-back before),
    # and acked through it: nothing is left unacked to come back after the timeout.
    assert "1 held messages kept across the reconnect" in worker.log_text()
    assert "held messages put back" not in worker.log_text()
    with broker_server.client() as broker:
        wait_until(lambda: broker.hlen("unacked") == 0, 10, "the kept message acked")
    third = ex_wait.delay("broker-crash", 0)  # and the key runs again
    runs = observer.runs_of("broker-crash", 3, timeout=45)
    assert [run.task_id for run in runs].count(second.id) == 1
    assert third.id in {run.task_id for run in runs}
    assert_no_overlap(runs)
    assert worker.is_running


def test_a_held_message_the_broker_took_back_is_not_put_back_again(
    workers: Workers, observer: Observer, broker_server: StoreServer
) -> None:
    """The broker lives; only one worker's connections to it are cut (``CLIENT KILL``).
    That worker's channel close gives its held message back to the queue and another
    worker takes it, under the same delivery tag. When the first reconnects it must not
    put that message back again (worker/transport/held_return.py: only what the close could not
    restore): it would be delivered twice, and the held request would run twice."""
    from tests.apps.exclusive import ex_wait

    # The other worker is ready before the first run starts, consuming nothing of the
    # task queue until just before the cut: started after the hold, a loaded machine took
    # longer to start it than the first run lasted, and nothing was held at the cut.
    other = workers.start(APP, concurrency=2, queues="not-yet")
    first_worker = workers.start(APP, concurrency=2)
    ex_wait.delay("cut", 8.0)
    wait_until(lambda: observer.running("cut") == 1, 20, "the first run")
    second = ex_wait.delay("cut", 0)
    wait_until(lambda: f"[{second.id}] held for" in first_worker.log_text(), 20, "held")
    replies = broadcast(
        ex_wait.app,
        lambda: ex_wait.app.control.add_consumer(
            "celery", destination=[other.name], reply=True, timeout=10
        ),
    )
    assert len(replies) == 1, f"the other worker does not consume the task queue: {replies}"
    assert observer.running("cut") == 1, "the first run ended before the cut"
    ports = {
        c.laddr.port
        for c in psutil.Process(first_worker.pid).net_connections(kind="tcp")
        if c.raddr and c.raddr.port == broker_server.port
    }
    assert ports, "the first worker's broker connections"
    with broker_server.client() as broker:
        for port in ports:
            broker.execute_command("CLIENT", "KILL", "ADDR", f"127.0.0.1:{port}")
    # The close gave the message back: the other worker takes it (or the first, once it
    # reconnected, since it consumes the queue too): either way it runs once.
    wait_until(
        lambda: (
            f"[{second.id}] received" in other.log_text()
            or first_worker.log_text().count(f"[{second.id}] received") >= 2
        ),
        30,
        "a worker to receive the message the close gave back",
    )
    wait_until(
        lambda: first_worker.log_text().count("Connected to redis://") >= 2,
        60,
        "the first worker to reconnect",
    )
    observer.runs_of("cut", 2, timeout=30)
    time.sleep(3.0)  # a second copy would wait for the key, then run
    runs = [run for run in observer.runs() if run.key == "cut"]
    assert [run.task_id for run in runs].count(second.id) == 1
    assert "held messages put back" not in first_worker.log_text()
    assert_no_overlap(runs)


@pytest.mark.timeout(180)
def test_a_release_notice_the_server_dropped_does_not_leave_its_waiter_for_the_timer(
    workers: Workers, observer: Observer, store_url: str
) -> None:
    """A waiter of an exclusive key is woken by the release's notice, on the worker's
    pub/sub connection; a holder with a 20 s lease sets its timer a lease away. The
    server drops that connection and refuses a new subscription for a moment, in which
    the holder ends: its notice is lost (as in a restart, a failover, a subscriber
    dropped over its output buffer limit). When the listener subscribes again, every
    held request asks again: the waiter starts then, not at its timer (20 s later)."""
    from tests.apps.exclusive import ex_wait

    env = {"BATON_TEST_APP_LEASE_TTL": "20"}
    # The holder on one worker, the waiter on another: a release wakes its own worker's
    # waiters directly, another worker's by the notice only.
    workers.start(APP, concurrency=1, queues="b", env=env)
    worker = workers.start(APP, concurrency=1, queues="a", env=env)
    # The pools and the listeners are up (after the store's grace: a lease, 20 s at most).
    for queue in "ab":
        assert ex_wait.apply_async((f"warm-{queue}", 0), queue=queue).get(timeout=60)
    holder = ex_wait.apply_async(("dropped", 3.0), queue="b")
    observer.starts_of("dropped")
    waiter = ex_wait.apply_async(("dropped", 0), queue="a")
    wait_until(lambda: f"[{waiter.id}] held for" in worker.log_text(), 20, "the waiter held")
    store = redis.Redis.from_url(store_url)
    # The listeners' connections dropped, and none subscribing again for a moment (the
    # release's own PUBLISH still allowed): the release's notice reaches no one.
    store.execute_command("ACL", "SETUSER", "default", "-subscribe")
    try:
        assert store.client_kill_filter(_type="pubsub") >= 1
        assert holder.get(timeout=30)
        ended = time.monotonic()
        time.sleep(1.0)  # not a wait: the notice was lost, the listeners try again
    finally:
        store.execute_command("ACL", "SETUSER", "default", "+subscribe")
    assert waiter.get(timeout=60)
    took = time.monotonic() - ended
    assert took < 10, f"the waiter started {took:.1f} s after the holder ended (its timer)"
    runs = [r for r in observer.runs() if r.key == "dropped"]
    assert len(runs) == 2 and runs[0].end <= runs[1].start
