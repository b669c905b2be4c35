"""A beat stopped while it waits for the store's answer stops, and resigns its lease.

Celery's beat handles SIGTERM in its signal handler: it syncs the scheduler, whose
``close`` resigns the leader lease (a store call), then raises ``SystemExit``. The
handler runs in the main thread wherever it is, often inside the tick's own store call,
blocked in the socket's read. In a CI run the resign went out on that same connection
and read the reply meant for the interrupted call (the lease renewal's), a list where it
wanted a number: ``TypeError`` in the handler took the place of its ``SystemExit``, the
tick failed, and the beat went on leading until a SIGKILL (tests/beat/
test_schedule_cli.py). The connection's side is made to happen deterministically in
tests/store/test_scripts.py (a SIGALRM handler's call during a waiting call); here the
beat's: the store SIGSTOPped so that a renewal waits in its read, SIGTERM, the store
resumed. (This one did not fail on the old code in three tries: the signal must land in
the renewal's read, not in the next slot's pipeline; it judges the whole stop.)
"""

from __future__ import annotations

import os
import signal
import time

import redis

from tests.beat.helpers import LEADER_KEY, beat_env, wait_for_leader
from tests.support.servers import StoreServer
from tests.support.waiting import wait_until
from tests.support.workers import Workers

APP = "tests.apps.beat_app"


def test_a_sigterm_while_the_beat_waits_for_the_store_stops_it_and_resigns(
    workers: Workers, store_server: StoreServer, store: redis.Redis
) -> None:
    # A lease of 1.5 s: renewed every 0.5 s, so that the tick under way when the store
    # stops answering is a renewal on the scripts' own connection (a slot's fire goes
    # through a pipeline of its own), as in the CI run.
    beat = workers.start_beat(APP, env=beat_env({"every1": {"every": 1}}, lease_ttl=1.5))
    wait_for_leader(store, [beat])
    store_server.pause()
    try:
        # The first call after the pause times out (the app's socket timeout, 1 s) and
        # says so; the tick after it, 1 s later, renews the lease and waits in its read
        # for another second: SIGTERM lands inside it.
        wait_until(lambda: "store unavailable" in beat.log_text(), 15, "the beat's first timeout")
        time.sleep(1.4)
        os.kill(beat.pid, signal.SIGTERM)
        time.sleep(0.3)
    finally:
        store_server.resume()
    deadline = time.monotonic() + 15
    while beat.is_running and time.monotonic() < deadline:
        time.sleep(0.1)
    log = beat.log_text()
    assert not beat.is_running, f"the beat went on after its SIGTERM:\n{beat.log_tail()}"
    assert "TypeError" not in log, log
    # Resigned on its way out (or, at worst, the lease runs out by itself): nobody leads.
    wait_deadline = time.monotonic() + 4  # past the 1.5 s lease, on a loaded machine
    while store.exists(LEADER_KEY) and time.monotonic() < wait_deadline:
        time.sleep(0.1)
    assert not store.exists(LEADER_KEY), f"the lease was not resigned: {store.hgetall(LEADER_KEY)}"
