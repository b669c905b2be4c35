"""``baton.cancel`` on Redis Cluster AND on Sentinel, through a store failover (issue 38
§2). Real workers whose ``BATON_URL`` is the production store: calls cancelled in the
broker, held in a worker and with a countdown, and a cancel by key; then the store
fails over (Sentinel: a planned failover; Cluster: the master holding the cancel
marker is SIGKILLed, its replica promoted) and a worker started after it must still
know every cancel. Judged by the observer and the result backend."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from types import ModuleType

import pytest
from celery import states

from celery_baton.core.keys import KeyNames
from tests.cancel.test_cancel import COUNTDOWN, cancel_timed, raced_with_cancel
from tests.failover.conftest import ProdStore
from tests.support.cluster_topology import ClusterTopology
from tests.support.observer import Observer
from tests.support.workers import Workers

APP = "tests.apps.cancel"


def _fail_over(prod_store: ProdStore) -> None:
    """Replicate what was written, then move the store to the replica."""
    topology = prod_store.topology
    marker = KeyNames("baton").cancels
    if isinstance(topology, ClusterTopology):
        victim = topology.master_of(marker)
        with victim.client() as client:
            assert int(client.execute_command("WAIT", 1, 5000)) >= 1
        victim.kill()
        time.sleep(3)  # not a wait: the replica's promotion (node timeout 1 s) happens here
    else:
        with topology.master().client() as client:
            assert int(client.execute_command("WAIT", 1, 5000)) >= 1
        old = topology.master().port
        topology.failover()
        deadline = time.monotonic() + 30
        while topology.master().port == old and time.monotonic() < deadline:
            time.sleep(0.2)
        assert topology.master().port != old, "no failover"


@pytest.mark.timeout(180)
def test_cancels_hold_on_the_production_stores_and_through_a_failover(
    prod_workers: Workers,
    prod_store: ProdStore,
    observer: Observer,
    use_store: Callable[[ModuleType, str], None],
) -> None:
    from tests.apps import cancel

    use_store(cancel, prod_store.url)
    # 55 calls at 5/s: 11 s of backlog, so that the last five are still waiting when they
    # are cancelled (40 gave 7 s: on a loaded machine, with the Cluster's slower cancels,
    # all five started within HAND_OVER of their cancel, and none was left to judge).
    calls = [cancel.limited.delay(n) for n in range(60)]
    keyed_7 = [cancel.keyed.delay(7, n) for n in range(5)]
    keyed_8 = [cancel.keyed.delay(8, n) for n in range(5)]
    in_broker = calls[55:]
    for result in in_broker:
        cancel.baton.cancel(result.id)
    cancel.baton.cancel(task=cancel.keyed, key={"account_id": 7})

    first = prod_workers.start(APP, concurrency=2)
    prod_workers.start(APP, concurrency=2)
    observer.wait_for(8, timeout=60)
    # Published once the workers run (tests/cancel/test_cancel.py: COUNTDOWN), so that
    # their cancels come before their ETA on a loaded machine.
    countdowns = [cancel.limited.apply_async((100 + n,), countdown=COUNTDOWN) for n in range(5)]
    due = time.monotonic() + COUNTDOWN
    started = {s["task_id"] for s in observer.started()}
    held = [r for r in calls[:55] if r.id not in started][-5:]
    raced = raced_with_cancel(observer, cancel_timed(cancel.baton, observer, held + countdowns))
    held = [r for r in held if r.id not in raced]
    later = [r for r in countdowns if r.id not in raced]
    assert len(held) >= 3
    assert len(later) >= 3

    first.stop()
    _fail_over(prod_store)
    prod_workers.start(APP, concurrency=2)  # after the failover: learns from the new master

    cancelled = {r.id for r in in_broker + held + later + keyed_7}
    expected = {r.id for r in calls + countdowns + keyed_8} - cancelled
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if set(Counter(s["task_id"] for s in observer.started())) >= expected:
            break
        time.sleep(0.2)
    # Not a wait: a cancelled call that would run runs now (a countdown one at its ETA).
    time.sleep(max(2.0, due + 2.0 - time.monotonic()))
    ran = Counter(s["task_id"] for s in observer.started())
    assert not set(ran) & cancelled, f"{len(set(ran) & cancelled)} cancelled calls ran"
    assert set(ran) == expected, f"{len(expected - set(ran))} calls never ran"
    assert max(ran.values()) == 1, "a call ran twice"
    deadline = time.monotonic() + 20
    results = in_broker + held + later + keyed_7
    while time.monotonic() < deadline and any(r.state != states.REVOKED for r in results):
        time.sleep(0.2)
    assert [r.id for r in results if r.state != states.REVOKED] == []
