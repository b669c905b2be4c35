"""A backlog held store-wide is spread over the workers once the hold ends, as plain
Celery would spread it: not run by the worker that happened to hold it.

While the store's grace lasts (new, or lost its data) or the store is down
(``baton_on_store_error="hold"``), every guarded request is held in the consumer, and
held requests raise the prefetch count: a worker up then takes the whole backlog from
the broker. Before: when the hold ended it ran all of it alone, at its own concurrency,
while a worker started meanwhile found the queue empty and idled (0 of 160 runs). Now
the holding worker hands back to the broker what it cannot start soon (past its
prefetch window), and both workers take from the queue.

Worker A (``-c 2``, Celery's prefetch multiplier 4) receives 160 calls of a 0.1 s task
(exclusive per call: each asks the gate, none waits for another) while the hold lasts;
worker B (a stand-in for another machine) starts while A holds them. Judged from the
observer: every call ran once, and B ran at least a quarter of them (an even share is
a half; A keeps its window's 8 and starts first); and the calls started about in their
publish order (a hand-back keeps it; not judged on a quorum queue, see ``Broker``). Each
on a Redis broker and on RabbitMQ (a classic and a quorum queue of the test's own;
skipped without RabbitMQ on 127.0.0.1:5672).
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import kombu
import pytest
import redis
from celery import Celery

from tests.support.machine import Machine
from tests.support.observer import Observer, Run
from tests.support.servers import StoreServer
from tests.support.waiting import wait_until
from tests.support.workers import WorkerProcess, Workers

APP = "tests.apps.spread"
TASK = "tests.apps.spread.work"
CALLS = 160
#: B's least share of the runs (an even share is a half; before: none).
B_SHARE = 0.25
#: The fresh store's grace: until its start + this. Long enough for A to start, take
#: the backlog and B to start on a machine twice loaded (each start ~3 s, up to ~8).
GRACE_TTL = 25.0
#: How many places a call may start away from the publish order of the calls its
#: worker ran (measured: 0-1 on Redis and a classic queue; 57-83 when the hand-back's
#: rejects went out in the order of Celery's ``call_soon``, a set; 48-49 when the
#: requests kept asked one after another, each behind those delivered meanwhile).
DISPLACED = 12


@pytest.fixture
def fresh() -> Iterator[StoreServer]:
    """A new ``redis-server`` without persistence, never declared new: it gets the grace
    of a store that may have lost its data (until its start + lease_ttl)."""
    server = StoreServer(name="fresh", persistent=False)
    server.start()
    yield server
    server.close()


@pytest.fixture
def kept() -> Iterator[StoreServer]:
    """A new ``redis-server`` with persistence, declared new (no grace): stopped and
    started again, it keeps its data, so only the outage holds requests."""
    server = StoreServer(name="kept", persistent=True)
    server.start()
    server.flushall()
    yield server
    server.close()


@dataclass
class Broker:
    """Where the test publishes, and what the workers' environment says of it."""

    env: dict[str, str]
    publisher: Celery
    ready: Callable[[], int]  # messages waiting in the queue (not delivered)
    # Whether the order a hand-back keeps is judged. Not on a quorum queue: RabbitMQ
    # requeues what a channel rejected grouped by the consumer it was delivered to, and
    # the task consumer was opened again for held requests every 12 of them
    # (consumer_window.py): they came back in groups of 12, the later groups first (a
    # call started 62 places early).
    ordered: bool = True

    def publish(self, calls: int) -> list[str]:
        with self.publisher.producer_or_acquire() as producer:
            return [
                self.publisher.send_task(TASK, args=(n,), producer=producer).id
                for n in range(calls)
            ]


@pytest.fixture(params=["redis", "rabbitmq", "rabbitmq-quorum"])
def broker(request: pytest.FixtureRequest, broker_url: str, workers: Workers) -> Iterator[Broker]:
    """The Redis broker server's db 0, or RabbitMQ with a queue of the test's own
    (deleted after, once the workers stopped): classic, or quorum (a prefetch per
    consumer, fixed once the consumer exists)."""
    if request.param == "redis":
        publisher = Celery("publisher", broker=broker_url, set_as_current=False)
        with redis.Redis.from_url(broker_url) as client:
            yield Broker({}, publisher, lambda: int(client.llen("celery")))
        publisher.close()
        return
    from tests.apps.spread import queues

    url = request.getfixturevalue("rabbitmq_url")
    queue = f"spread-{secrets.token_hex(4)}"
    queue_type = "quorum" if request.param.endswith("quorum") else ""
    publisher = Celery("publisher", broker=url, set_as_current=False)
    publisher.conf.task_default_queue = queue
    publisher.conf.task_queues = queues(queue, queue_type)
    try:
        yield Broker(
            {"TEST_BROKER_URL": url, "SPREAD_QUEUE": queue, "SPREAD_QUEUE_TYPE": queue_type},
            publisher,
            lambda: _ready_in(url, queue),
            ordered=not queue_type,
        )
    finally:
        workers.stop_all(timeout=10)
        publisher.close()
        with contextlib.suppress(Exception), kombu.Connection(url) as conn:
            conn.default_channel.queue_delete(queue)


def _ready_in(url: str, queue: str) -> int:
    """The messages ready in ``queue`` (not those delivered and unacknowledged)."""
    with kombu.Connection(url) as conn:
        _, ready, _ = conn.default_channel.queue_declare(queue, passive=True)
        return int(ready)


def _judge(
    name: str,
    observer: Observer,
    sent: list[str],
    a: WorkerProcess,
    b: WorkerProcess,
    *,
    ordered: bool,
) -> None:
    """Once every call ran: each ran once, B ran its share, in about publish order."""
    wait_until(lambda: len(observer.runs()) >= len(sent), 60, f"{len(sent)} runs")
    time.sleep(0.5)  # a duplicate would show up meanwhile
    runs = observer.runs()
    ids = [run.task_id for run in runs]
    assert sorted(ids) == sorted(sent), (
        f"{len(ids)} runs of {len(set(ids))} ids for {len(sent)} calls "
        f"(lost {len(set(sent) - set(ids))})"
    )
    counts = Counter(run.key for run in runs)
    ran_a, ran_b = counts[a.hostname], counts[b.hostname]
    position = {task_id: n for n, task_id in enumerate(sent)}
    moved = {w.hostname: _moved(runs, w.hostname, position) for w in (a, b)}
    back = [line for line in a.log_text().splitlines() if "handed back to the broker" in line]
    print(f"\n{name}: A ran {ran_a}, B ran {ran_b} of {CALLS}; places moved {moved}")
    print("\n".join(back[:3]))
    assert ran_a + ran_b == CALLS, counts
    assert ran_b >= B_SHARE * CALLS, f"B ran {ran_b} of {CALLS} (A {ran_a})"
    if ordered:
        assert max(moved.values()) <= DISPLACED, f"out of publish order: {moved}"


def _moved(runs: list[Run], hostname: str, position: dict[str, int]) -> int:
    """The most places a run of ``hostname`` started away from the publish order of the
    calls that worker ran (each worker's own: two workers share the backlog's order,
    but not their pace)."""
    mine = sorted((run for run in runs if run.key == hostname), key=lambda run: run.start)
    order = sorted(position[run.task_id] for run in mine)
    rank = {n: i for i, n in enumerate(order)}
    return max((abs(i - rank[position[run.task_id]]) for i, run in enumerate(mine)), default=0)


def _start_b(workers: Workers, tmp_path: Path, env: dict[str, str]) -> WorkerProcess:
    machine = Machine(tmp_path / "b")
    return workers.start(APP, env={**env, **machine.env}, cwd=machine.cwd, concurrency=2)


@pytest.mark.timeout(120)
def test_a_backlog_held_for_the_grace_is_spread_when_it_ends(
    workers: Workers, observer: Observer, fresh: StoreServer, broker: Broker, tmp_path: Path
) -> None:
    env = {**broker.env, "BATON_URL": fresh.url(0), "SPREAD_LEASE_TTL": str(GRACE_TTL)}
    a = workers.start(APP, env=env, concurrency=2)
    sent = broker.publish(CALLS)
    wait_until(lambda: broker.ready() == 0, 30, "A took the backlog")
    b = _start_b(workers, tmp_path, env)
    assert not observer.started(), "the grace ended before B was up: raise GRACE_TTL"
    _judge("GRACE", observer, sent, a, b, ordered=broker.ordered)


@pytest.mark.timeout(120)
def test_a_backlog_held_while_the_store_was_down_is_spread_when_it_is_back(
    workers: Workers, observer: Observer, kept: StoreServer, broker: Broker, tmp_path: Path
) -> None:
    env = {**broker.env, "BATON_URL": kept.url(0)}
    a = workers.start(APP, env=env, concurrency=2)
    kept.stop()
    sent = broker.publish(CALLS)
    wait_until(lambda: broker.ready() == 0, 30, "A took the backlog")
    b = _start_b(workers, tmp_path, env)
    assert not observer.started(), "a call ran while the store was down"
    kept.start()
    # The order each worker ran its calls in is judged after a grace only: after an
    # outage, one CI run under load saw calls 41 and 50 places from it (the requests
    # held for the store ask again on their back-off as well as at the hold's end).
    _judge("STORE DOWN", observer, sent, a, b, ordered=False)


#: The calls that fill the cap while A takes the backlog: as long as B's start may take
#: on a machine twice loaded (see GRACE_TTL).
BLOCK = 25.0


@pytest.mark.timeout(120)
@pytest.mark.xfail(
    strict=True,
    reason="a backlog held for a limit is not spread: hold_end.py hands back only at a "
    "store-wide hold's end (B ran 0 of 160)",
)
def test_a_backlog_held_for_a_full_cap_is_spread_when_the_cap_frees(
    workers: Workers, observer: Observer, kept: StoreServer, broker_url: str, tmp_path: Path
) -> None:
    """The same hoard with the store up: requests refused by a full cap are held, held
    requests raise the prefetch count, and so worker A, its pool free while 4 calls of
    another worker fill the cap of 4, takes the whole backlog of 160. When the cap frees,
    A runs them 2 at a time (its pool) while worker B, started meanwhile, finds the queue
    empty: the cap is wider than A's pool, and half of it is left unused."""
    from tests.apps.spread import CAP

    env = {"BATON_URL": kept.url(0)}
    task = "tests.apps.spread.capped"
    publisher = Celery("publisher", broker=broker_url, set_as_current=False)
    filler = workers.start(APP, env=env, concurrency=CAP, queues="fill")
    a = workers.start(APP, env=env, concurrency=2)
    with publisher.producer_or_acquire() as producer:
        for n in range(CAP):
            publisher.send_task(task, args=(-1 - n, BLOCK), queue="fill", producer=producer)
    wait_until(lambda: len(observer.started()) == CAP, 30, "the cap filled")
    with publisher.producer_or_acquire() as producer:
        sent = [publisher.send_task(task, args=(n,), producer=producer).id for n in range(CALLS)]
    with redis.Redis.from_url(broker_url) as client:
        wait_until(lambda: client.llen("celery") == 0, 30, "A took the backlog")
    b = _start_b(workers, tmp_path, env)
    assert len(observer.started()) == CAP, "the cap freed before B was up: raise BLOCK"
    publisher.close()
    wait_until(lambda: len(observer.runs()) >= CALLS + CAP, 60, f"{CALLS} runs")
    runs = [run for run in observer.runs() if run.task_id in set(sent)]
    counts = Counter(run.key for run in runs)
    ran_a, ran_b = counts[a.hostname], counts[b.hostname]
    print(f"\nCAP: A ran {ran_a}, B ran {ran_b} of {CALLS} (filler {filler.hostname})")
    assert sorted(run.task_id for run in runs) == sorted(sent)
    assert ran_b >= B_SHARE * CALLS, f"B ran {ran_b} of {CALLS} (A {ran_a})"
