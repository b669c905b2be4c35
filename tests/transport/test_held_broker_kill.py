"""Held requests survive the broker's crash (issue 24, seed 1112 of the soak).

A request held by celery-baton is an unacknowledged message: kombu's Redis transport
keeps it in the broker's unacked index while the consumer holds it. When the broker is
SIGKILLed and restarted, every held message must come back and run exactly once: put
back at the reconnect, handed back at the hold horizon, or restored by the visibility
timeout. The observer lives on its own server, outside the broker that is killed.

One loss is kombu's, not ours: its Redis transport pops a message before it records it
as unacknowledged, so a kill between the two loses it. Every delivery of a message is
such a moment, and a held message is delivered again after each hand-back and each
put-back (seen here about once in ten runs of a loaded machine, and in the soak's seed
1112). A missing message is accepted only if a kill came within moments of its last
hand-back or put-back, and then at most a few (docs/failure.md).
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter
from collections.abc import Iterator

import pytest

from celery_baton.worker.transport.broker import restore_scan_period
from tests.soak.checker import KILL_SLACK, REDELIVERY_WINDOW, broker_moments
from tests.support.celery_processes import WorkerProcess
from tests.support.observer import Observer
from tests.support.servers import StoreServer
from tests.support.workers import Workers

APP = "tests.apps.limits"
VISIBILITY = 15  # s: the hold horizon is a third of it, 5 s (as in the soak)
TASKS = 120  # at 4/s: 30 s of held backlog
#: The kill schedules to run (HELD_KILL_SEEDS=4,5,6 for more than the one CI runs).
SEEDS = [int(s) for s in os.environ.get("HELD_KILL_SEEDS", "1").split(",")]
#: The workers' pool (HELD_KILL_POOL=threads: CountedSlots instead of Celery's semaphore).
POOL = os.environ.get("HELD_KILL_POOL", "prefork")


@pytest.fixture
def outside() -> Iterator[Observer]:
    server = StoreServer(name="observed", persistent=False)
    server.start()
    obs = Observer(server.url(0))
    try:
        yield obs
    finally:
        obs.close()
        server.close()


def _broker_state(broker_server: StoreServer) -> str:
    with broker_server.client(0) as client:
        return (
            f"queue celery: {client.llen('celery')}, unacked: {client.hlen('unacked')}, "
            f"unacked_index: {client.zcard('unacked_index')}, "
            f"mutex: {client.get('unacked_mutex')!r}"
        )


def _last_moments(workers: list[WorkerProcess]) -> dict[str, tuple[int, bool]]:
    """Each task id's last moment in any worker's log (us), and whether it was handed
    to the broker then (handed back at the horizon, or put back after a reconnect)."""
    moments: dict[str, tuple[int, bool]] = {}
    for worker in workers:
        for task_id, moment in broker_moments(worker.log_text()).items():
            moments[task_id] = max(moments.get(task_id, moment), moment)
    return moments


@pytest.mark.timeout(300)  # 150 where kombu scans every second (5.7): see the deadline
@pytest.mark.parametrize("seed", SEEDS)
def test_held_messages_run_once_across_broker_kills(
    workers: Workers, broker_server: StoreServer, outside: Observer, seed: int
) -> None:
    from tests.apps import limits

    env = {
        "LIMITS_VISIBILITY": str(VISIBILITY),
        "LIMITS_HOLD_HORIZON": str(VISIBILITY / 3),
        "LIMITS_ACKS_LATE": "1",
        "LIMITS_PREFETCH": "4",
        "TEST_OBSERVER_URL": outside.url,
    }
    pair = [workers.start(APP, concurrency=2, pool=POOL, env=env) for _ in range(2)]
    ids = [limits.trickle.delay(n).id for n in range(TASKS)]

    # SIGKILL the broker every 1-4 s for 25 s, down 0.3-2 s each time, while up to a
    # hundred requests are held: some held longer than half the visibility timeout when
    # the workers reconnect, some handed back at the horizon in the moment of a kill.
    started_at = time.monotonic()
    rng = random.Random(seed)
    kills: list[float] = []  # when each SIGKILL was sent (seconds since the epoch)
    at = 1.0
    while at < 25:
        time.sleep(max(0.0, started_at + at - time.monotonic()))
        kills.append(time.time())
        broker_server.restart(kill=True, down_for=rng.uniform(0.3, 2.0))
        at += rng.uniform(1.0, 4.0)

    # A held message the reconnect did not keep (claimed more than half the visibility
    # timeout before it) comes back through kombu's visibility scan: within the broker's
    # redelivery window (docs/failure.md: twice the timeout, the scan's period and its
    # mutex's expiry), then runs behind the others at 4/s. kombu before 5.7 scans every
    # 100 s whatever the app asks (its 1 s is a kombu 5.7 setting): on Celery 5.3 such a
    # message came back 112 s after its last claim, ran, and the test had stopped
    # waiting at 105 s.
    options = limits.app.conf.broker_transport_options
    window = 2 * VISIBILITY + restore_scan_period(options) + options["unacked_mutex_expire"]
    deadline = time.monotonic() + max(3 * VISIBILITY, window) + TASKS / 4 + 30
    while time.monotonic() < deadline:
        ran = Counter(s["task_id"] for s in outside.started())
        if set(ids) <= set(ran):
            break
        time.sleep(0.5)
    time.sleep(2)  # a duplicate would start now
    ran = Counter(s["task_id"] for s in outside.started())
    missing = [i for i in ids if i not in ran]
    # kombu's Redis transport pops a message (BRPOP) before it records it as unacked:
    # one that a broker SIGKILL catches between the two is lost, on its first delivery
    # or on any later one (docs/failure.md). A held message is delivered again after
    # each hand-back and each put-back, within moments. So a missing message must have
    # been last seen, handed to the broker, at most REDELIVERY_WINDOW before a kill;
    # one lost otherwise was lost by celery-baton.
    unexplained = []
    moments = _last_moments(pair)
    for task_id in missing:
        at, handed = moments.get(task_id, (0, False))
        # The kill is recorded just before the signal is sent: a put-back logged a few
        # ms after it had already run.
        if not handed or not any(
            -KILL_SLACK <= kill - at / 1e6 <= REDELIVERY_WINDOW for kill in kills
        ):
            unexplained.append((task_id, at / 1e6, "handed to the broker" if handed else "held"))
    print(f"\nHELD KILL: {len(missing)} of {TASKS} lost in kombu's delivery window")
    logs = "\n".join(w.log_tail(80) for w in pair)
    assert not unexplained, (
        f"{len(unexplained)} of {TASKS} never ran, not in a kill's delivery window: "
        f"{unexplained[:5]}; kills at {kills}; broker: {_broker_state(broker_server)}\n{logs}"
    )
    assert len(missing) <= 3, f"{len(missing)} lost in kombu's window: more than chance"
    # A run whose ack a kill lost runs again (acks_late, the guard off: at least once).
    # Its first run ended moments before a kill; a held request never started, so no
    # other run repeats.
    first_end = {r.task_id: r.end for r in sorted(outside.runs(), key=lambda r: -r.end)}
    twice = {
        task_id: n
        for task_id, n in ran.items()
        if n > 1
        and not any(-KILL_SLACK <= kill - first_end[task_id] / 1e6 <= 1.0 for kill in kills)
    }
    assert not twice, f"ran more than once, not a lost ack: {twice}; kills at {kills}\n{logs}"
    # kombu drops a message whose restore found no queue to put it in (it logs this).
    assert "Could not restore message" not in logs
