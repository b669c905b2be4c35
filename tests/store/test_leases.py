"""Leases against a real server: acquisition, owner-compared release, fences.

Issue 2, item 4: release never frees a lease owned by someone else. These tests drive
the scripts directly (no Celery), so each race is made to happen deterministically.
Renewal is in test_lease_renewal.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import redis

from celery_baton import BatonError, LeaseNotOwned, StoreUnavailable
from celery_baton.core.gate import Gate, HeldLease
from celery_baton.core.leases import Lease, LeaseBook, new_owner
from celery_baton.store.connection import Store, connect
from tests.store.lease_helpers import KEY, owners
from tests.support.servers import StoreServer


@pytest.fixture
def store(store_url: str) -> Iterator[Store]:
    connected = connect(store_url, socket_timeout=1.0)
    yield connected
    connected.client.close()


@pytest.fixture
def gate(store: Store) -> Gate:
    return Gate(store)


def test_acquire_is_exclusive_and_release_frees(gate: Gate, r: redis.Redis) -> None:
    a, b = Lease(gate, KEY, ttl=5), Lease(gate, KEY, ttl=5)
    assert a.acquire() and a.fence > 0
    assert not b.acquire()
    assert b.holder == a.owner and b.fence == 0
    assert list(owners(r)) == [a.owner]
    assert a.release() is True
    assert owners(r) == {}
    assert b.acquire() and b.fence > a.fence
    assert a.release() is False  # a second release frees nothing


def test_expired_owner_cannot_release_the_new_owners_lease(gate: Gate, r: redis.Redis) -> None:
    """A pauses past its ttl, B takes the key, A wakes and releases: B keeps it."""
    a, b = Lease(gate, KEY, ttl=0.2), Lease(gate, KEY, ttl=30)
    assert a.acquire()
    time.sleep(0.3)  # A's lease expires while "A is paused"
    assert b.acquire()
    assert b.fence > a.fence

    assert a.release() is False
    assert a.renew() is False  # renewing a lost lease reports it lost
    assert [x.status for x in gate.renew([HeldLease(KEY, a.owner, 1, 30)])] == [0]

    assert list(owners(r)) == [b.owner]
    c = Lease(gate, KEY, ttl=30)
    assert not c.acquire() and c.holder == b.owner
    assert b.release() is True


def test_owner_tokens_are_unique_per_delivery() -> None:
    first, second = new_owner("task-1", "w@h"), new_owner("task-1", "w@h")
    assert first != second
    assert first.split("|")[:2] == second.split("|")[:2] == ["task-1", "w@h"]


def test_fences_strictly_increase_across_acquisitions_and_key_loss(
    gate: Gate, r: redis.Redis
) -> None:
    fences = []
    for i in range(10):
        lease = Lease(gate, KEY, ttl=5)
        assert lease.acquire()
        fences.append(lease.fence)
        assert lease.release()
        if i == 5:
            r.delete(KEY)  # the store lost the key (or it expired): still no repeat
    assert fences == sorted(set(fences))


def test_reacquire_by_the_same_owner_keeps_its_fence(gate: Gate) -> None:
    owner = new_owner("t", "w")
    first, again = Lease(gate, KEY, owner=owner), Lease(gate, KEY, owner=owner)
    assert first.acquire() and again.acquire()
    assert again.fence == first.fence


def test_a_limit_above_one_admits_that_many(gate: Gate) -> None:
    key = "baton:{t}:cc:k"
    leases = [Lease(gate, key, ttl=2, limit=2) for _ in range(3)]
    assert [lease.acquire() for lease in leases] == [True, True, False]
    assert leases[2].holder in {leases[0].owner, leases[1].owner}
    assert leases[1].release()
    assert leases[2].acquire()


def test_release_publishes_a_notice_only_when_it_frees_a_key_someone_waits_for(
    gate: Gate, store: Store
) -> None:
    pubsub = store.client.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe("baton:released")
    try:
        assert pubsub.get_message(timeout=1) is None  # subscribe confirmation swallowed
        holder, other = Lease(gate, KEY), Lease(gate, KEY)
        # Nobody waits: releasing sends nothing.
        assert holder.acquire()
        assert holder.release() is True
        assert pubsub.get_message(timeout=0.2) is None
        # Someone was denied: the release that frees the key tells them.
        assert holder.acquire()
        assert other.acquire() is False
        assert other.release() is False  # frees nothing, tells nobody
        assert holder.release() is True
        message = pubsub.get_message(timeout=2)
        assert message is not None and message["data"] == KEY
        assert pubsub.get_message(timeout=0.2) is None  # exactly one notice
    finally:
        pubsub.close()


def test_lease_as_a_context_manager(gate: Gate, r: redis.Redis) -> None:
    with Lease(gate, KEY) as lease:
        assert lease.fence > 0
        with pytest.raises(LeaseNotOwned, match=KEY), Lease(gate, KEY):
            pass
        assert list(owners(r)) == [lease.owner]
    assert owners(r) == {}


def test_store_down_raises_store_unavailable_and_queued_releases_retry(
    store_server: StoreServer, gate: Gate, r: redis.Redis
) -> None:
    lease = Lease(gate, KEY, ttl=30)
    assert lease.acquire()
    book = LeaseBook(gate, interval=10)
    store_server.kill()
    try:
        with pytest.raises(StoreUnavailable) as down:
            Lease(gate, KEY).acquire()
        assert isinstance(down.value, BatonError)
        assert isinstance(down.value.__cause__, redis.ConnectionError | OSError)
        with pytest.raises(StoreUnavailable):
            lease.release()
        book.retry_later(lease.release)
        with pytest.raises(StoreUnavailable):
            book.renew_now()
    finally:
        store_server.start()
    assert list(owners(r)) == [lease.owner]  # acknowledged writes survived the crash
    book.renew_now()  # the queued release runs now
    assert owners(r) == {}


def test_concurrent_acquirers_get_one_winner_each_round(store_url: str) -> None:
    """Many threads, own connections: every round has exactly one holder at a time."""
    holders: list[int] = []
    overlaps: list[str] = []
    active = threading.Semaphore(1)

    def contend(n: int) -> None:
        store = connect(store_url, socket_timeout=5)
        gate = Gate(store)
        try:
            for _ in range(30):
                lease = Lease(gate, KEY, ttl=5)
                if lease.acquire():
                    if not active.acquire(blocking=False):
                        overlaps.append(f"thread {n} got the lease while another held it")
                    else:
                        holders.append(n)
                        active.release()
                    assert lease.release()
        finally:
            store.client.close()

    threads = [threading.Thread(target=contend, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert overlaps == []
    assert holders
