"""A run that ends while its worker is cut off from the broker frees its key at its end
(issue 34, item e).

Celery tells the worker's main process of a run's end on the consumer's event loop,
which does not turn while the consumer reconnects to the broker (a broker restart, a
network cut: seconds, or as long as the broker stays away). Meanwhile the worker's lease
renewer, a thread of its own, went on renewing the finished run's lease: an
``exclusive`` duplicate published on another worker was skipped as held by a run that
had ended (the nemesis soak saw one skipped 4.8 s after its holder's end). The pool
process that ran the body now frees the run's leases as the body ends, and the renewer
is told by the store that the lease ended with its run (not lost: no error is logged).
"""

from __future__ import annotations

import pytest

from tests.support.observer import Observer, assert_no_overlap
from tests.support.pools import ALL_POOLS, EVENTLET
from tests.support.servers import StoreServer
from tests.support.waiting import wait_until
from tests.support.workers import Workers

APP = "tests.apps.exclusive"
KEY = "cut-off"

POOLS = ALL_POOLS


@pytest.mark.parametrize("pool", POOLS)
def test_a_run_ending_while_its_worker_has_no_broker_frees_its_key(
    pool: str, workers: Workers, observer: Observer, own_broker: StoreServer
) -> None:
    from kombu import Connection

    from tests.apps.exclusive import ex_skip

    # A: its own broker; results and the observer on the shared server, which stays up.
    cut_off = workers.start(
        APP, pool=pool, concurrency=2, env={"TEST_BROKER_URL": own_broker.url(0)}
    )
    other = workers.start(APP, concurrency=2)
    with Connection(own_broker.url(0)) as connection:
        holder = ex_skip.apply_async((KEY, 3.0), connection=connection)
    wait_until(lambda: observer.running(KEY) == 1, 30, "the holder's run to start")
    own_broker.kill()  # and it stays away: A's consumer keeps reconnecting
    # Its caller sees it end: the result is stored after the run's end is recorded.
    assert holder.get(timeout=30)
    assert cut_off.is_running

    duplicate = ex_skip.delay(KEY, 0)  # on the shared broker: only the other worker
    assert duplicate.get(timeout=30), (
        f"skipped: {other.log_text()[-1500:]}\nA: {cut_off.log_text()}"
    )
    runs = observer.runs_of(KEY, 2, timeout=10)
    assert [run.task_id for run in runs] == [holder.id, duplicate.id]
    assert_no_overlap(runs)

    # A's broker comes back; A learns of the end and records it again (nothing left to
    # free), and its renewer never read the ended lease as lost.
    own_broker.start()
    wait_until(lambda: cut_off.log_text().count("Connected to redis://") >= 2, 60, "A to reconnect")
    wait_until(lambda: f"[{holder.id}] succeeded" in cut_off.log_text(), 30, "A to see the end")
    log = cut_off.log_text()
    assert "lease lost" not in log and "lost its lease" not in log, log[-3000:]
    assert cut_off.is_running


@pytest.mark.parametrize("pool", ["gevent", EVENTLET])
def test_a_green_worker_keeps_its_lease_while_it_reconnects(
    pool: str, workers: Workers, observer: Observer, own_broker: StoreServer
) -> None:
    """kombu's reconnect waited with the unpatched ``time.sleep`` on a green pool: every
    greenlet, the lease renewer too, stood still for 2, 4, 6 ... s between connection
    attempts. With a 3 s ``lease_ttl`` the lease ran out during the 4 s wait, the other
    worker's waiting call ran, and the frozen body went on beside it (worker/pool/green.py)."""
    from kombu import Connection

    from tests.apps.exclusive import LEASE_TTL, ex_long

    assert LEASE_TTL <= 3.0  # shorter than the reconnect's third wait (4 s)
    cut_off = workers.start(
        APP, pool=pool, concurrency=2, env={"TEST_BROKER_URL": own_broker.url(0)}
    )
    workers.start(APP, concurrency=2)
    with Connection(own_broker.url(0)) as connection:
        holder = ex_long.apply_async(("frozen", 12.0), connection=connection)
    wait_until(lambda: observer.running("frozen") == 1, 30, "the holder's run to start")
    own_broker.kill()
    waiting = ex_long.delay("frozen", 0)  # the other worker: waits for the key
    assert waiting.get(timeout=60)
    assert holder.get(timeout=60)
    runs = observer.runs_of("frozen", 2, timeout=10)
    assert [run.task_id for run in runs] == [holder.id, waiting.id]
    assert_no_overlap(runs)
    assert "lease lost" not in cut_off.log_text(), cut_off.log_text()[-3000:]
