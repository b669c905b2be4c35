"""Debounce and throttle on real workers, judged by the observer (its own server and
clock) and by the results a caller gets; nothing here trusts the library's word.

Issue 15 §2. The tasks are in tests/apps/debounce.py (debounce and windows of 1 s).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from celery_baton.errors import TaskSkipped
from tests.support.observer import Observer, Run
from tests.support.pools import TIME_LIMIT_POOLS, pool_label, pool_setting
from tests.support.servers import StoreServer
from tests.support.waiting import wait_until
from tests.support.workers import Workers

APP = "tests.apps.debounce"


def server_time_us(server: StoreServer) -> int:
    """The observer's clock (the broker server's TIME), in microseconds."""
    with server.client() as client:
        seconds, micros = client.time()
    return int(seconds) * 1_000_000 + int(micros)


def version(run: Run) -> int:
    return int(run.task_id.rsplit("|", 1)[1])


def runs_of(observer: Observer, key: str) -> list[Run]:
    return [r for r in observer.runs() if r.key == key]


def settled(observer: Observer, key: str, n: int, quiet: float = 2.5) -> list[Run]:
    """The runs of ``key`` once there are ``n`` and none came for ``quiet`` seconds more
    (a second run would come within one debounce)."""
    observer.runs_of(key, n, timeout=30)
    time.sleep(quiet)
    return runs_of(observer, key)


def test_a_burst_from_every_publish_path_runs_once_with_the_last_arguments(
    workers: Workers, observer: Observer, broker_server: StoreServer
) -> None:
    from celery import group

    from tests.apps.debounce import app, save

    pair = [workers.start(APP, concurrency=2), workers.start(APP, concurrency=2)]
    results: list[Any] = []
    paths = [
        lambda v: save.delay("doc", v),
        lambda v: save.apply_async(("doc", v)),
        lambda v: app.send_task(save.name, ("doc", v)),
        lambda v: save.s("doc", v).delay(),
        lambda v: group([save.s("doc", v)]).apply_async().results[0],
    ]
    for v in range(1, 11):
        # Before the publish: the burst's last moment is recorded after it (by the
        # publisher once sent, or by the worker that got the message first), so the
        # quiet time counts from later than this, never earlier. (Read after the loop,
        # it was up to 0.11 s later than the worker's record on a loaded machine.)
        last_publish = server_time_us(broker_server)
        results.append(paths[v % len(paths)](v))
        time.sleep(0.05)
    (run,) = settled(observer, "save:doc", 1)

    assert version(run) == 10, "ran with the last publish's arguments"
    assert run.task_id.startswith(results[-1].id)
    # Quiet for the debounce (1 s) on the observer's clock, within an order of magnitude.
    assert run.start - last_publish >= 900_000
    assert run.start - last_publish < 10_000_000
    # Every superseded publish resolves to the run that replaced it.
    assert [r.get(timeout=10) for r in results] == [10] * 10
    # Every skip is logged, naming a newer publish.
    logs = pair[0].log_text() + pair[1].log_text()
    assert logs.count("skipped: superseded (debounced) by task") == 9
    # Another key is debounced apart.
    other = save.delay("other", 1)
    assert other.get(timeout=10) == 1


def test_a_held_publish_costs_no_pool_slot(workers: Workers, observer: Observer) -> None:
    """One pool process: while the debounced publish waits for quiet, other work runs."""
    from tests.apps.debounce import ping, save

    workers.start(APP, concurrency=1)
    held = save.delay("slot", 1)
    assert ping.delay("slot", 1).get(timeout=10) == 1
    assert held.get(timeout=10) == 1
    (other,) = runs_of(observer, "ping:slot")
    (debounced,) = runs_of(observer, "save:slot")
    assert other.end <= debounced.start


def test_a_stream_from_celery_beat_runs_once_after_beat_stops(
    workers: Workers, observer: Observer
) -> None:
    """Beat publishes through ``app.send_task`` too: a publish every 0.3 s never leaves
    the key quiet for 1 s, so nothing runs until beat stops; then exactly once."""
    workers.start(APP, concurrency=1)
    beat = workers.start_beat(APP, env={"DEBOUNCE_BEAT": "1"})
    wait_until(lambda: beat.log_text().count("Sending due task") >= 6, 20, "6 beat publishes")
    assert runs_of(observer, "save:beat") == []
    beat.stop()
    (run,) = settled(observer, "save:beat", 1)
    assert version(run) == 7


def test_a_steady_stream_is_cut_at_max_wait(workers: Workers, observer: Observer) -> None:
    from tests.apps.debounce import capped

    workers.start(APP, concurrency=2)
    # One publish every 0.2 s for 6 s: never quiet for the 1 s debounce.
    results = []
    began = time.monotonic()
    for v in range(1, 31):
        results.append(capped.delay("doc", v))
        time.sleep(0.2)
    lasted = time.monotonic() - began
    during = runs_of(observer, "capped:doc")
    runs = settled(observer, "capped:doc", len(during) + 1)

    # max_wait (2.5 s) cut it while publishes went on: once per 2.5 s of the stream
    # (at least 6 s), then the last one.
    assert 2 <= len(during) <= lasted / 2.5 + 1, ([version(r) for r in runs], lasted)
    assert len(runs) == len(during) + 1
    assert version(runs[-1]) == 30
    versions = [version(r) for r in runs]
    assert versions == sorted(versions) and len(set(versions)) == len(versions)
    assert results[-1].get(timeout=10) == 30
    assert results[0].get(timeout=10) == versions[0]  # resolved to the run of its burst


def test_throttle_drop_runs_the_first_in_each_window(workers: Workers, observer: Observer) -> None:
    from tests.apps.debounce import ping

    workers.start(APP, concurrency=2)
    first = [ping.delay("u", v) for v in range(1, 6)]
    (run,) = settled(observer, "ping:u", 1, quiet=1.5)
    assert version(run) == 1
    assert first[0].get(timeout=10) == 1
    for dropped in first[1:]:
        with pytest.raises(TaskSkipped, match="throttled"):
            dropped.get(timeout=10)
    # After the window, the next one runs again at once.
    assert ping.delay("u", 6).get(timeout=10) == 6


def test_throttle_trailing_runs_the_first_and_then_the_newest(
    workers: Workers, observer: Observer
) -> None:
    from tests.apps.debounce import sync

    workers.start(APP, concurrency=2)
    results = []
    for v in range(1, 6):
        results.append(sync.delay("u", v))
        time.sleep(0.05)
    runs = settled(observer, "sync:u", 2)

    assert [version(r) for r in runs] == [1, 5]
    assert runs[1].start - runs[0].start >= 900_000  # the window: 1 s
    assert [r.get(timeout=10) for r in results] == [1, 5, 5, 5, 5]


def test_a_worker_killed_while_it_holds_the_latest_loses_nothing(
    workers: Workers, observer: Observer
) -> None:
    """SIGKILL the worker that holds the burst's latest (waiting for quiet): the message
    was not acked, the broker hands it out again, and the next worker runs it once."""
    from tests.apps.debounce import save

    short = {"DEBOUNCE_VISIBILITY": "3"}
    victim = workers.start(APP, concurrency=1, env=short)
    results = [save.delay("k", v) for v in range(1, 6)]
    # The last publish held (received: kombu has recorded it as unacked), not an earlier
    # one: a worker SIGKILLed while it takes a message off the queue may lose it in
    # kombu's Redis transport (BRPOP, then the unacked record; docs/soak.md).
    latest = f"save[{results[-1].id}] held for"
    wait_until(lambda: latest in victim.log_text(), 10, "the latest held")
    victim.kill()
    assert runs_of(observer, "save:k") == []
    workers.start(APP, concurrency=1, env=short)
    (run,) = settled(observer, "save:k", 1)
    assert version(run) == 5
    assert [r.get(timeout=10) for r in results] == [5] * 5


PUBLISHER = """
import os, signal, sys
from celery import signals
from tests.apps.debounce import save

@signals.{hook}.connect
def die(body=None, **kw):
    args = body[0] if isinstance(body, tuple) else []
    if args and args[1] == 4:
        os.kill(os.getpid(), signal.SIGKILL)

for v in range(1, 6):
    save.delay("crash", v)
"""


@pytest.mark.parametrize(
    ("hook", "runs_with"),
    [
        # Killed just before the broker took publish 4: 3 is the last that exists.
        ("before_task_publish", 3),
        # Killed just after the broker took publish 4, before the store heard of it:
        # the worker adopts that message as the latest on arrival.
        ("after_task_publish", 4),
    ],
)
def test_a_publisher_killed_between_broker_and_store_loses_nothing(
    workers: Workers, observer: Observer, hook: str, runs_with: int
) -> None:
    """Whichever side of the broker send the publisher dies on, the burst runs once,
    with the arguments of the last message that exists (publish 5 never happened)."""
    workers.start(APP, concurrency=1)
    env = {**os.environ, **workers.env}
    script = PUBLISHER.format(hook=hook)
    proc = subprocess.run([sys.executable, "-c", script], env=env, timeout=30, check=False)
    assert proc.returncode == -signal.SIGKILL
    (run,) = settled(observer, "save:crash", 1)
    assert version(run) == runs_with


def test_store_down_at_publish_sends_anyway_and_the_worker_adopts_it(
    workers: Workers, observer: Observer, store_server: StoreServer, caplog: Any
) -> None:
    """The message is sent before the store is asked: with the store down the caller
    gets its AsyncResult (a WARNING says it was not recorded), and once the store is
    back the worker adopts the message and runs it."""
    from tests.apps.debounce import save

    store_server.kill()
    try:
        result = save.delay("down", 1)
    finally:
        store_server.start()
    assert "sent but not recorded for debounce" in caplog.text
    workers.start(APP, concurrency=1)
    assert result.get(timeout=20) == 1
    (run,) = settled(observer, "save:down", 1, quiet=1.5)
    assert version(run) == 1


def test_a_run_that_retries_still_resolves_the_superseded(
    workers: Workers, observer: Observer
) -> None:
    """The retried delivery (same task id) is told again which ids it stands for."""
    from tests.apps.debounce import flaky

    workers.start(APP, concurrency=1)
    results = [flaky.delay("r", v) for v in range(1, 4)]
    assert [r.get(timeout=20) for r in results] == [3, 3, 3]
    assert [version(r) for r in runs_of(observer, "flaky:r")] == [3]


def test_a_run_whose_pool_child_is_killed_fails_the_superseded_too(
    workers: Workers, observer: Observer
) -> None:
    """The child never reached its postrun: the main process writes the failure it
    records for the run to the ids it stood for, so no caller waits forever."""
    from celery.exceptions import WorkerLostError

    from tests.apps.debounce import slow

    workers.start(APP, concurrency=1)
    results = [slow.delay("victim", v) for v in range(1, 4)]
    (start,) = observer.starts_of("slow:victim", timeout=20)
    os.kill(start["pid"], signal.SIGKILL)
    for result in results:
        with pytest.raises(WorkerLostError):
            result.get(timeout=20)


@pytest.mark.parametrize("pool", TIME_LIMIT_POOLS)
def test_a_run_killed_at_its_time_limit_fails_the_superseded_too(
    workers: Workers, observer: Observer, pool: str
) -> None:
    """Past its hard time limit Celery kills the run's process (prefork) or unwinds its
    greenlet (gevent) and fails it with TimeLimitExceeded; no postrun writes the ids it
    stood for: the main process writes that failure to them, on both pools, and on a
    prefork pool recycled after every task or autoscaled."""
    from celery.exceptions import TimeLimitExceeded

    from tests.apps.debounce import overrun

    name, extra, env = pool_setting(pool)
    workers.start(APP, pool=name, concurrency=2, extra_args=extra, env=env)
    doc = f"limit-{pool_label(pool)}"
    results = [overrun.delay(doc, v) for v in range(1, 4)]
    for result in results:
        with pytest.raises(TimeLimitExceeded):
            result.get(timeout=30)
    starts = [s for s in observer.started() if s["key"] == f"overrun:{doc}"]
    assert [s["task_id"].rsplit("|", 1)[1] for s in starts] == ["3"], "one run, the last"


@pytest.mark.parametrize("pool", TIME_LIMIT_POOLS)
def test_a_run_revoked_mid_run_revokes_the_superseded_too(
    workers: Workers, observer: Observer, pool: str
) -> None:
    """``revoke(terminate=True)`` of the run that stands for earlier publishes: Celery
    records it REVOKED in the main process and no postrun writes the ids it stood for;
    the main process writes that state to them, so their callers are not left waiting
    (before: every superseded caller's ``.get()`` timed out, on both pools). Also on a
    prefork pool recycled after every task or autoscaled."""
    from celery.exceptions import TaskRevokedError

    from tests.apps.debounce import app, slow
    from tests.support.waiting import revoke_until_heard

    name, extra, env = pool_setting(pool)
    workers.start(APP, pool=name, concurrency=2, extra_args=extra, env=env)
    doc = f"revoked-{pool_label(pool)}"
    results = [slow.delay(doc, v) for v in range(1, 4)]
    (start,) = observer.starts_of(f"slow:{doc}", timeout=20)
    revoke_until_heard(app, start["task_id"].split("|")[0], terminate=True)
    for result in results:
        with pytest.raises(TaskRevokedError):
            result.get(timeout=20)


def test_a_rate_limit_lifted_while_a_publish_is_held_does_not_skip_the_debounce(
    workers: Workers, observer: Observer
) -> None:
    """With ``baton_global_rate_limits``, lifting a task's rate_limit at runtime rebuilds
    a held delivery's plan: the rebuilt plan must still ask its debounce (a superseded
    publish ran when it did not)."""
    from tests.apps.debounce import app, rated

    worker = workers.start(APP, concurrency=1, env={"DEBOUNCE_GLOBAL_RATES": "1"})
    for v in range(1, 4):
        rated.delay("lift", v)
    wait_until(lambda: "held for" in worker.log_text(), 10, "the latest held")
    replies = app.control.rate_limit(rated.name, "0", reply=True, timeout=5, limit=1)
    assert len(replies) == 1, replies
    last = rated.delay("lift", 4)  # wakes the held 3: superseded
    assert last.get(timeout=10) == 4
    runs = settled(observer, "rated:lift", 1, quiet=1.5)
    assert [version(r) for r in runs] == [4]
