"""Script calls on the direct socket path: overlap, order, errors, fork, restarts."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import redis
from redis.exceptions import ResponseError

from celery_baton.core.conditions import TakeLease
from celery_baton.core.gate import Gate
from celery_baton.errors import StoreUnavailable
from celery_baton.store import connect
from celery_baton.store.connection import STORE_ERRORS
from tests.support.servers import StoreServer


def _claim(store_url: str) -> tuple[object, str]:
    store = connect(store_url)
    return store, f"baton:{{t}}:uq:{os.urandom(4).hex()}"


def test_sent_calls_are_answered_in_order_whichever_is_read_first(store_url: str) -> None:
    store, key = _claim(store_url)
    scripts = store.scripts  # type: ignore[attr-defined]
    first = scripts.send("unique_claim", [key, key + "-gb"], ["id-1", 60_000])
    second = scripts.send("unique_claim", [key, key + "-gb"], ["id-2", 60_000])
    # Reading the second reads the first's reply on the way and keeps it for it.
    assert scripts.result(second) == "id-1"
    assert scripts.result(first) in ("", None)
    # A blocking call made while nothing is pending is unaffected.
    assert scripts.call("unique_release", [key], ["id-1"]) == 1


def test_an_error_reply_is_raised_to_its_own_caller_only(store_url: str) -> None:
    store, key = _claim(store_url)
    scripts = store.scripts  # type: ignore[attr-defined]
    bad = scripts.send("unique_claim", [key, key + "-gb"], ["id-1", "not-a-number"])
    good = scripts.send("unique_claim", [key, key + "-gb"], ["id-2", 60_000])
    with pytest.raises(ResponseError):
        scripts.result(bad)
    assert scripts.result(good) in ("", None)


def test_script_flush_between_sent_calls_reloads_and_keeps_the_order(store_url: str) -> None:
    store, key = _claim(store_url)
    scripts = store.scripts  # type: ignore[attr-defined]
    scripts.call("unique_release", [key], ["nobody"])  # the connection exists
    redis.Redis.from_url(store_url).script_flush()
    first = scripts.send("unique_claim", [key, key + "-gb"], ["id-1", 60_000])
    second = scripts.send("unique_release", [key], ["id-1"])
    third = scripts.send("unique_claim", [key, key + "-gb"], ["id-3", 60_000])
    # NOSCRIPT for all three: each is sent again after a SCRIPT LOAD, in order.
    assert scripts.result(third) in ("", None)
    assert scripts.result(first) in ("", None)
    assert scripts.result(second) == 1
    assert redis.Redis.from_url(store_url, decode_responses=True).get(key) == "id-3"


def test_script_flush_before_pipelined_calls_reloads_and_keeps_the_order(
    store_url: str,
) -> None:
    """``call_many`` writes its calls without loading the script first: after a SCRIPT
    FLUSH (a restarted server) every one is refused NOSCRIPT, loaded and sent again, and
    they still run in the order given."""
    store, key = _claim(store_url)
    scripts = store.scripts  # type: ignore[attr-defined]
    scripts.call("unique_release", [key], ["nobody"])  # the connection exists
    redis.Redis.from_url(store_url).script_flush()
    claims = [([key, key + "-gb"], [f"id-{i}", 60_000]) for i in range(3)]
    first, *others = scripts.call_many("unique_claim", claims)
    assert first in ("", None)  # claimed: the first call ran first
    assert others == ["id-0", "id-0"]
    assert redis.Redis.from_url(store_url, decode_responses=True).get(key) == "id-0"


def test_a_forked_child_uses_its_own_connection(store_url: str) -> None:
    """A pool child inherits the parent's per-thread connection object; reading from
    that socket in the child would steal the parent's replies."""
    store = connect(store_url)
    gate = Gate(store)
    key = f"baton:{{t}}:ex:{os.urandom(4).hex()}"
    assert gate.decide([TakeLease(key)], owner="parent|w|1").granted
    in_flight = store.scripts.send(
        "unique_claim", [key + ":uq", key + ":uq" + "-gb"], ["parent", 60_000]
    )
    pid = os.fork()
    if pid == 0:
        try:
            decision = gate.decide([TakeLease(key)], owner="child|w|1")
            os._exit(0 if not decision.granted and decision.holder == "parent|w|1" else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    # The parent's reply was left for the parent, and its connection is in step.
    assert store.scripts.result(in_flight) in ("", None)
    assert gate.release([key], owner="parent|w|1") == 1
    assert gate.decide([TakeLease(key)], owner="parent|w|2").granted


def test_a_restarted_store_fails_the_calls_in_flight_then_reconnects(
    store_server: StoreServer, store_url: str
) -> None:
    store = connect(store_url)
    scripts = store.scripts
    key = f"baton:{{t}}:uq:{os.urandom(4).hex()}"
    scripts.call("unique_release", [key], ["nobody"])
    store_server.pause()
    try:
        pending = scripts.send("unique_claim", [key, key + "-gb"], ["id-1", 60_000])
    finally:
        store_server.restart(kill=True, down_for=0.2)
    with pytest.raises(STORE_ERRORS):
        scripts.result(pending)
    # The next call starts a new connection (the scripts are loaded again).
    assert scripts.call("unique_claim", [key, key + "-gb"], ["id-2", 60_000]) in ("", None)
    with pytest.raises(StoreUnavailable):
        Gate(connect("redis://127.0.0.1:1/0")).decide([TakeLease("k")], owner="o|w|1")


@pytest.mark.parametrize("kill", [False, True])
def test_the_first_call_after_the_store_restarted_goes_through(
    store_url: str, store_server: StoreServer, kill: bool
) -> None:
    """An idle line the server closed (a restart, a failover) is replaced before it is
    written on: the first publish after the store came back must not fail (seen in CI:
    a unique publish raised StoreUnavailable, BrokenPipeError, with the store up)."""
    store, key = _claim(store_url)
    scripts = store.scripts  # type: ignore[attr-defined]
    assert scripts.call("unique_claim", [key, key + "-gb"], ["id-1", 60_000]) in ("", None)
    store_server.restart(kill=kill)
    time.sleep(1.1)  # idle past the check interval, as a line between two publishes
    assert scripts.result(
        scripts.send("unique_claim", [key + "x", key + "x" + "-gb"], ["id-2", 60_000])
    ) in (
        "",
        None,
    )


def test_calls_from_short_lived_greenlets_leave_no_connection_behind(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gevent and eventlet make ``threading.local`` per greenlet, and a greenlet lives for
    one task or one timer entry: a connection kept per "thread" was a connection lost per
    greenlet, and redis-py's pool (100) ran out within seconds (issue 34: a gevent
    worker's asks failed with MaxConnectionsError after ~20 tasks)."""
    gevent_local = pytest.importorskip("gevent.local")
    gevent = pytest.importorskip("gevent")
    monkeypatch.setattr(threading, "local", gevent_local.local)  # what patch_all does
    store, key = _claim(store_url)
    scripts = store.scripts  # type: ignore[attr-defined]

    def one_task(i: int) -> None:
        scripts.call("unique_claim", [key, key + "-gb"], [f"id-{i}", 60_000])
        scripts.call_many("unique_release", [([key], [f"id-{i}"]), ([key], [f"id-{i}"])])

    for i in range(150):
        gevent.spawn(one_task, i).join()
    pool = store.client.connection_pool  # type: ignore[attr-defined]
    assert len(pool._available_connections) + len(pool._in_use_connections) <= 2


def _pool_size(store: object) -> int:
    pool = store.client.connection_pool  # type: ignore[attr-defined]
    return len(pool._available_connections) + len(pool._in_use_connections)


def test_calls_from_threads_that_ended_give_their_connection_back(store_url: str) -> None:
    """A line is a thread's own connection; a thread per call (a ``threading.Timer``, a
    thread per request) kept one of redis-py's 100 for good: the nemesis soak's timer
    thread per ``baton.cancel`` failed every cancel with MaxConnectionsError after ~100
    (issue 38). A line whose thread ended goes back to the pool when the next is made."""
    store, key = _claim(store_url)
    scripts = store.scripts  # type: ignore[attr-defined]
    failed: list[BaseException] = []

    def one_call(i: int) -> None:
        try:
            scripts.call("unique_claim", [key, key + "-gb"], [f"id-{i}", 60_000])
            scripts.call("unique_release", [key], [f"id-{i}"])
        except BaseException as exc:
            failed.append(exc)

    for i in range(150):
        thread = threading.Thread(target=one_call, args=(i,))
        thread.start()
        thread.join()
    assert not failed, failed[0]
    assert _pool_size(store) <= 2
    # Threads alive at once keep a line each, and get their own replies.
    barrier = threading.Barrier(5)

    def together(i: int) -> None:
        barrier.wait()
        one_call(1000 + i)

    threads = [threading.Thread(target=together, args=(i,)) for i in range(5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failed, failed[0]
    assert _pool_size(store) <= 6
    store.client.connection_pool.disconnect()  # type: ignore[attr-defined]


def test_a_line_dropped_on_a_store_error_gives_its_connection_back(
    store_server: StoreServer, store_url: str
) -> None:
    """Every store error drops the thread's line; each dropped line kept its connection
    out of the pool, so a worker thread through 100 store errors (restarts, pauses past
    the socket timeout) could reach the store no more (MaxConnectionsError, issue 38)."""
    store, key = _claim(store_url)
    scripts = store.scripts  # type: ignore[attr-defined]
    for _ in range(150):
        scripts.call("unique_release", [key], ["nobody"])
        scripts._drop(scripts._local.line, ConnectionError("the store went away"))
    assert scripts.call("unique_release", [key], ["nobody"]) == 0
    assert _pool_size(store) <= 2
    # Through a real restart too.
    store_server.restart(kill=True, down_for=0.2)
    with pytest.raises(STORE_ERRORS):
        scripts.call("unique_release", [key], ["nobody"])
    assert scripts.call("unique_release", [key], ["nobody"]) == 0
    assert _pool_size(store) <= 2
    store.client.connection_pool.disconnect()  # type: ignore[attr-defined]


def test_a_call_made_by_a_signal_handler_during_a_call_gets_its_own_reply(
    store_url: str, store_server: StoreServer
) -> None:
    """Celery's beat resigns its lease from its SIGTERM handler, which runs wherever the
    main thread is: often inside a script call waiting for its reply. The handler's call
    went out on the same connection and read the waiting call's reply (a CI run's beat:
    ``TypeError`` in the handler, no exit, the lease kept); the waiting call then read
    the handler's. Made to happen here: the store SIGSTOPped, a call waiting on it, a
    SIGALRM handler that resumes the store and makes a call of its own."""
    store, key = _claim(store_url)
    scripts = store.scripts  # type: ignore[attr-defined]
    assert scripts.call("unique_claim", [key, key + "-gb"], ["id-1", 60_000]) in ("", None)
    nested: dict[str, object] = {}

    def handler(signum: int, frame: object) -> None:
        store_server.resume()
        nested["reply"] = scripts.call("unique_release", [key], ["nobody"])

    before = signal.signal(signal.SIGALRM, handler)
    try:
        store_server.pause()
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        outer = scripts.call("unique_claim", [key, key + "-gb"], ["id-2", 60_000])
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)
        store_server.resume()
    assert nested == {"reply": 0}, "the handler's call read another call's reply"
    assert outer == "id-1", "the waiting call read the handler's reply"
    # The connection goes on in step.
    assert scripts.call("unique_release", [key], ["id-1"]) == 1
