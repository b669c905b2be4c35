"""A held message whose record the broker refused is given back, not lost.

kombu's Redis transport records a delivered message as unacknowledged (``QoS.append``:
the unacked hash and its index) and every way it gives one back reads it from there:
a reject with requeue and a hand-back (``QoS.restore_by_tag``), a closing channel's
restore (``Channel._restore``). celery-baton sends that record without waiting for the
reply (worker/transport/broker_writes.py); when the broker refuses it or the connection
breaks before it lands, the message is known to the worker alone. A message that runs
is acked and nothing is lost, but one celery-baton holds (for a rate, here) is given
back later, and kombu's restore found nothing to put back: the message was dropped
without a word (a rated call of the CI soak at stop 52 "never ran and is not accounted
for").

The refusal is made to happen without touching anything else the worker does: the
broker's ACL denies ``HSET`` (the record's write of the message, nowhere else on the
worker's way) while the held call is delivered, and allows it again. The call then goes back
the three ways a held call does: handed back at the hold horizon, restored as its
channel closes (the worker's broker connections cut), and taken back after the broker
was SIGKILLed and restarted (its record lost with it, as a record in flight is).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from tests.support.observer import Observer
from tests.support.servers import StoreServer
from tests.support.waiting import wait_until
from tests.support.workers import Workers

APP = "tests.apps.limits"
REFUSED = "was not recorded unacked"


@contextmanager
def _records_refused(broker: StoreServer) -> Iterator[None]:
    """The broker refuses kombu's record of a delivery (its ``HSET``) meanwhile."""
    with broker.client() as client:
        client.execute_command("ACL", "SETUSER", "default", "-hset")
        try:
            yield
        finally:
            client.execute_command("ACL", "SETUSER", "default", "+@all")


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("way_back", "pool"),
    [
        ("hand-back", "prefork"),
        ("reconnect", "prefork"),
        ("broker restart", "prefork"),
        # The other pools whose worker sends the record without waiting (an event loop);
        # gevent and eventlet keep kombu's own record, which raises before the call is
        # received at all (kombu's loss, docs/failure.md).
        ("hand-back", "threads"),
        ("broker restart", "solo"),
    ],
)
def test_a_held_call_whose_record_was_refused_runs(
    way_back: str, pool: str, workers: Workers, observer: Observer, broker_server: StoreServer
) -> None:
    from tests.apps import limits

    # paced: one start per 5 s; a call refused by the rate is held, and handed back
    # at the hold horizon (2 s) to come again.
    worker = workers.start(
        APP,
        pool=pool,
        concurrency=1,
        env={"LIMITS_HOLD_HORIZON": "2", "LIMITS_VISIBILITY": "30"},
    )
    first = limits.paced.delay().id
    wait_until(lambda: len(observer.started()) == 1, 30, "the first call to run")
    with _records_refused(broker_server):
        held = limits.paced.delay().id
        wait_until(lambda: REFUSED in worker.log_text(), 20, "the held call's record refused")
        if way_back == "hand-back":
            # Refused until then: the worker sends the record again every second, and
            # a record that landed would be given back by kombu as any other.
            wait_until(
                lambda: "handed back to the broker" in worker.log_text(), 20, "the hand-back"
            )
        elif way_back == "reconnect":
            # The worker's broker connections are cut while it holds the call: its
            # consumer starts again and takes back what it held.
            with broker_server.client() as client:
                client.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
        elif way_back == "broker restart":
            # The broker dies (its data kept) while the worker holds the call: nothing
            # can be restored as the connection goes; the consumer takes back what it
            # held once connected again (worker/transport/held_return.py).
            broker_server.restart(kill=True, down_for=1.0)
    wait_until(
        lambda: held in {s["task_id"] for s in observer.started()},
        40,
        f"the held call {held} to run (worker log:\n{worker.log_tail(60)})",
    )
    time.sleep(2)  # a second run of either would start now
    runs = Counter(s["task_id"] for s in observer.started())
    assert runs == {first: 1, held: 1}, runs
    log = worker.log_text()
    # It came back the way named: from the worker's copy, not from a record after all.
    assert "from the worker's copy" in log or "put back in their queues" in log, log[-3000:]


@pytest.mark.timeout(120)
def test_a_running_call_whose_record_was_refused_comes_back_after_its_worker_dies(
    workers: Workers, observer: Observer, broker_server: StoreServer
) -> None:
    """An ``acks_late`` call runs while its record is refused; the worker is SIGKILLed
    mid-run. Its message must be the broker's to deliver again (at least once): the
    worker sent the record again once the broker took records."""
    from tests.apps import limits

    env = {"LIMITS_ACKS_LATE": "1", "LIMITS_VISIBILITY": "5"}
    first = workers.start(APP, concurrency=1, env=env)
    # The store was emptied for this test: no new lease for lease_ttl (3 s, a grace),
    # and a call held meanwhile would be given back, not run with its record refused.
    time.sleep(limits.SHORT_LEASE_TTL + 0.5)
    with _records_refused(broker_server):
        call = limits.limited.delay(8.0, 1).id
        wait_until(lambda: REFUSED in first.log_text(), 20, "the call's record refused")
    wait_until(lambda: observer.running("limited") == 1, 20, "the call to run")
    assert "put back in its queue" not in first.log_text()  # it runs as it was delivered
    time.sleep(2.5)  # the record is sent again within a second or two of the ACL's end
    first.kill()
    workers.start(APP, concurrency=1, env=env)
    # Back after the visibility timeout (5 s) and the next restore scan (every second).
    wait_until(
        lambda: Counter(s["task_id"] for s in observer.started())[call] >= 2,
        60,
        "the killed run's message delivered again and run",
    )
