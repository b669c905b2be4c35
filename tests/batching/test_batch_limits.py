"""A batch run is one start of a ``global_rate_limit``, one slot of a
``global_concurrency`` and one admission of each named limit (``limits=``, its ``cost=``
priced on the batch's calls), across all workers (issue 37), judged at the batch body's
start by the observer (its own server's clock). Tasks in tests/apps/batching.py.

Before, all three were refused at declaration with a batch; so was ``fair_key``, which
now shares a limit among a batched task's fair keys, one batch run one admission.
"""

from __future__ import annotations

import time

import pytest

from celery_baton.errors import CostError
from tests.batching.test_batching import assert_each_call_once, call_ids, runs_of, settle
from tests.limits.test_at_start import START_JITTER_US
from tests.limits.test_fairness import received_us
from tests.limits.test_rate_limits import assert_gcra_bound, server_time_us
from tests.limits.test_shared import weighted_excess
from tests.support.observer import Observer, assert_no_overlap, max_concurrent
from tests.support.servers import StoreServer
from tests.support.waiting import broadcast, wait_until
from tests.support.workers import Workers

APP = "tests.apps.batching"
BATCH_LEASE_TTL = 8.0  # the app's baton_lease_ttl (tests/apps/batching.py)
KEYS = 4
PER_KEY = 10


def _two_workers(workers: Workers) -> None:
    """Two workers of 2 processes each: a batch's run could start on any of 4."""
    for _ in range(2):
        workers.start(APP, concurrency=2, wait=False)
    for w in workers.started:
        w.wait_ready()


def _publish(task: object) -> dict[str, tuple[object, int]]:
    sent: dict[str, tuple[object, int]] = {}
    for n in range(PER_KEY):
        for account in range(KEYS):
            doc = account * 100 + n
            result = task.apply_async(kwargs={"account": account, "doc": doc})  # type: ignore[attr-defined]
            sent[result.id] = (result, doc)
    return sent


def test_batch_runs_start_within_a_global_rate_limit(workers: Workers, observer: Observer) -> None:
    from tests.apps.batching import paced_batch

    _two_workers(workers)
    sent = _publish(paced_batch)
    runs = settle(observer, "paced_batch", len(sent), timeout=90)
    assert_each_call_once(runs, list(sent))
    assert len(runs) >= KEYS * PER_KEY // 5  # batches of at most 5
    for result, doc in sent.values():
        assert result.get(timeout=30) == doc * 2  # type: ignore[attr-defined]
    # Judged at the batch body's first line: the hand-over's noise is allowed for (as
    # for a plain task's start), a second run let through early is not.
    assert_gcra_bound([r.start for r in runs], per_second=2.0, tolerance_us=START_JITTER_US)


def test_batch_runs_hold_one_slot_of_a_global_concurrency(
    workers: Workers, observer: Observer
) -> None:
    from tests.apps.batching import single_batch

    _two_workers(workers)
    sent = _publish(single_batch)
    runs = settle(observer, "single_batch", len(sent), timeout=90)
    assert_each_call_once(runs, list(sent))
    assert all(len(call_ids(r)) <= 5 for r in runs)
    for result, doc in sent.values():
        assert result.get(timeout=30) == doc * 2  # type: ignore[attr-defined]
    assert_no_overlap(runs, per_key=False)


def test_batch_runs_spend_a_named_limit_by_their_number_of_calls(
    workers: Workers, observer: Observer
) -> None:
    """``limits=["partner"], cost=len`` (10/s, a bucket of 5; batches of up to 5): in any
    window of the bodies' starts, the calls started sum to at most the bucket plus the
    window's refill, the hand-over's noise allowed for (a quarter second of refill,
    2.5 calls; without the limit 40 calls start within about a second, 30 too many)."""
    from tests.apps.batching import PARTNER, partner_batch

    _two_workers(workers)
    sent = _publish(partner_batch)
    runs = settle(observer, "partner_batch", len(sent), timeout=90)
    assert_each_call_once(runs, list(sent))
    assert all(len(call_ids(r)) <= 5 for r in runs)
    assert len(runs) < len(sent), "no batch held more than one call: cost=len not exercised"
    for result, doc in sent.values():
        assert result.get(timeout=30) == doc * 2  # type: ignore[attr-defined]
    per_second = 10.0
    assert PARTNER == {"rate": "10/s", "burst": 5}
    excess = weighted_excess(
        [(r.start, float(len(call_ids(r)))) for r in runs], per_second, burst=5
    )
    assert excess <= START_JITTER_US / 1e6 * per_second, (
        f"calls started beyond the partner limit by {excess:.1f} "
        f"(runs: {[(r.start, len(call_ids(r))) for r in runs]})"
    )


def test_a_batch_weighing_more_than_the_limit_runs_the_part_that_fits(
    workers: Workers, observer: Observer
) -> None:
    """``cost=`` a callable of the calls (their weights; "partner" holds 5): a batch that
    weighs more runs the calls that fit and gives the others back to the next batch, so
    the key is never stuck; a call that alone weighs more than the limit holds fails
    with a CostError and never runs (as a plain task's would)."""
    from tests.apps.batching import weighed_batch

    _two_workers(workers)
    sent = {}
    for n in range(12):
        result = weighed_batch.apply_async(kwargs={"account": 1, "doc": n, "weight": 2})
        sent[result.id] = (result, n)
    heavy = weighed_batch.apply_async(kwargs={"account": 1, "doc": 99, "weight": 6})
    runs = settle(observer, "weighed_batch", len(sent), timeout=90)
    assert_each_call_once(runs, list(sent))
    assert all(len(call_ids(r)) <= 2 for r in runs), "a run weighed more than 5"
    for result, doc in sent.values():
        assert result.get(timeout=30) == doc * 2
    with pytest.raises(CostError, match="larger than the burst 5"):
        heavy.get(timeout=30)
    assert heavy.id not in {c for r in runs for c in call_ids(r)}
    # Publish after the heavy call failed: the key still batches.
    late = weighed_batch.apply_async(kwargs={"account": 1, "doc": 7, "weight": 1})
    assert late.get(timeout=30) == 14


#: A's backlog and B's calls (batches of 4: 50 of A's, 4 of B's).
A_CALLS, B_CALLS = 200, 16


def test_fair_key_shares_a_limit_between_tenants_by_batch_runs(
    workers: Workers, observer: Observer, store_server: StoreServer
) -> None:
    """Tenant A's backlog of 50 batches, then tenant B's 4, on a cap of 2 batch runs
    shared by 3 workers (6 pool processes): once the workers hold B's calls, B's batch
    runs take their turns with A's (judged at the bodies' starts). A's runs take every
    slot again once B has nothing waiting. (The same test without the fair key no
    longer shows first come first served starting A's backlog first reliably: since a
    batching worker takes its messages in several at a time, its batches of two keys
    alternate often without one, 10-15 A runs against a bound of 18-19.)"""
    from tests.apps.batching import FAIR_CAP, fair_batch

    task = fair_batch
    name = task.name.rsplit(".", 1)[-1]
    for _ in range(3):
        workers.start(APP, concurrency=2, wait=False, queues="not-yet")
    for w in workers.started:
        w.wait_ready()
    # A store up for less than a run ttl (the session's first test) lets no batch be
    # claimed until then (core/batch.py, ``epoch``): every batch of both tenants would
    # be claimed at once, and the order they ask in would be no one's.
    with store_server.client() as client:
        up = int(client.info("server")["uptime_in_seconds"])
    time.sleep(max(0.0, BATCH_LEASE_TTL + 1 - up))

    # A's backlog queued before the workers consume it, B's calls published once A's
    # first runs ended: A's batches are then claimed and waiting for the cap. (Queued
    # together, the workers take both tenants' calls in at once, and first come first
    # served alternates the two keys' batches as well: the comparison would show
    # nothing.)
    def publish(tenant: str, count: int) -> list[str]:
        return [
            task.apply_async(kwargs={"tenant": tenant, "account": tenant, "doc": n}).id
            for n in range(count)
        ]

    sent = publish("A", A_CALLS)
    opened = server_time_us(observer)
    replies = broadcast(
        task.app,
        lambda: task.app.control.add_consumer("celery", reply=True, timeout=10, limit=3),
    )
    assert len(replies) == 3, f"not every worker consumes the task queue: {replies}"
    wait_until(lambda: len(runs_of(observer, name)) >= 6, timeout=30, what="A's first runs")
    sent += publish("B", B_CALLS)
    runs = settle(observer, name, len(sent), timeout=120)
    assert_each_call_once(runs, sent)
    a_runs = [r for r in runs if r.key == f"{name}:A"]
    b_runs = [r for r in runs if r.key == f"{name}:B"]
    assert len(a_runs) + len(b_runs) == len(runs), "a batch held calls of both tenants"
    # The cap holds across batch runs, and is used.
    assert max_concurrent(runs) == FAIR_CAP

    b_received = received_us(workers.started, {i for r in b_runs for i in call_ids(r)})
    last_b = max(r.start for r in b_runs)
    unstarted = sum(r.start > b_received for r in a_runs)  # A's backlog then
    overtaking = sum(b_received < r.start < last_b for r in a_runs)
    print(
        f"{name}: A {len(a_runs)} runs, B {len(b_runs)} runs; B received "
        f"{(b_received - opened) / 1e6:.2f} s after the open, A had {unstarted} unstarted "
        f"then, {overtaking} of them started before B's last start "
        f"({(last_b - b_received) / 1e6:.2f} s after); starts after the open (s): "
        f"A {[round((r.start - opened) / 1e6, 2) for r in a_runs]}, "
        f"B {[round((r.start - opened) / 1e6, 2) for r in b_runs]}"
    )
    assert unstarted >= 3 * len(b_runs), f"A's backlog was done before B came: {unstarted}"
    # Fair: B's runs alternate with A's, about one A start per B run, plus the runs
    # already asked for (a cap's worth per worker) and a fifth of A's backlog for a
    # loaded machine; first come first served starts most of A's backlog first.
    bound = len(b_runs) + 3 * FAIR_CAP + unstarted // 5
    assert overtaking <= bound
    last_b_end = max(r.end for r in b_runs)
    assert max_concurrent([r for r in a_runs if r.start > last_b_end]) == FAIR_CAP
