"""A run's end recorded on a store that then restarts empty (no persistence) still keeps
the run's copy from running (the redelivery guard's done marker; a beat slot's run
record goes the same way).

A guarded run ends and its ack fails (the broker's writes paused), so the broker gives
the message back; meanwhile the store is SIGKILLed and starts again without its data,
the run's record gone. The worker that recorded the end writes it again once it sees
the store forgot (its own report gone, or a grace refusal), and the copy, held by the
new store's grace, is acked without running.
"""

from __future__ import annotations

import time

from tests.support.observer import Observer
from tests.support.run_ends import ACK_FAILED, assert_the_copy_does_not_run, holds_done_marker
from tests.support.servers import StoreServer
from tests.support.waiting import wait_until
from tests.support.workers import Workers

APP = "tests.apps.ackfail"


def test_an_end_lost_with_a_store_that_restarted_empty_still_stops_the_copy(
    workers: Workers,
    observer: Observer,
    store_server: StoreServer,
    broker_server: StoreServer,
) -> None:
    from tests.apps.ackfail import stop_mark, uq_ack_guarded

    worker = workers.start(APP, concurrency=2)
    first = uq_ack_guarded.delay("kf")
    wait_until(lambda: observer._redis.exists(stop_mark(first.id)), 30, "the run to ask")
    with broker_server.client() as admin:
        admin.execute_command("CLIENT", "PAUSE", 120_000, "WRITE")
        try:
            wait_until(lambda: ACK_FAILED in worker.log_text(), 60, "the ack to fail")
            time.sleep(1.0)  # the main process records the end again right after the line
            assert holds_done_marker(store_server, first.id), "the end was not recorded"
            store_server.restart_empty()
        finally:
            admin.execute_command("CLIENT", "UNPAUSE")

    assert_the_copy_does_not_run(worker, observer, first.id)
