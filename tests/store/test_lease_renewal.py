"""Lease renewal against a real server: the batch renewal, the lease book, and what the
store forgot.

Issue 11, item 2: a renewal never brings back a lease that was released, unlocked or
expired, and still writes back a live one that the store forgot. These tests drive the
scripts directly (no Celery), so each race is made to happen deterministically.
Acquisition and release are in test_leases.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from celery_baton import StoreUnavailable
from celery_baton.core.gate import ENDED, Gate, HeldClaim, HeldLease, Release, Renewal
from celery_baton.core.keys import KeyNames
from celery_baton.core.leases import Lease, LeaseBook
from celery_baton.core.shared_ends import ENDING, SharedEnds
from celery_baton.store import inspect as store_inspect
from celery_baton.store.connection import Store, connect
from tests.store.lease_helpers import KEY, owners
from tests.support.servers import StoreServer
from tests.support.waiting import wait_until


@pytest.fixture
def store(store_url: str) -> Iterator[Store]:
    connected = connect(store_url, socket_timeout=1.0)
    yield connected
    connected.client.close()


@pytest.fixture
def gate(store: Store) -> Gate:
    return Gate(store)


def test_renew_batch_reports_renewed_lost_and_reasserted(gate: Gate, r: redis.Redis) -> None:
    alive = Lease(gate, "baton:{t}:ex:alive", ttl=30)
    lost = Lease(gate, "baton:{t}:ex:lost", ttl=0.2)
    vanished = Lease(gate, "baton:{v}:ex:vanished", ttl=30)
    taken = Lease(gate, "baton:{t}:ex:taken", ttl=0.2)
    for lease in (alive, lost, vanished, taken):
        assert lease.acquire()
    time.sleep(0.3)
    assert Lease(gate, lost.key, ttl=30).acquire()  # someone took the expired key
    # The store forgot family {v} (its data and its epoch: a restart without persistence).
    r.delete(vanished.key, KeyNames().epoch("v"))
    r.hdel(taken.key, f"o:{taken.owner}")
    assert Lease(gate, taken.key, ttl=30).acquire()  # gone, and someone else holds it

    batch = [HeldLease(x.key, x.owner, 1, 30, x.epoch) for x in (alive, lost, vanished, taken)]
    renewals = gate.renew(batch)
    assert [x.status for x in renewals] == [1, 0, 2, 0]
    assert renewals[2].epoch not in ("", vanished.epoch)  # the store's new epoch
    assert r.get(KeyNames().epoch("v")) == renewals[2].epoch
    assert gate.renew([]) == []

    # Renewed and re-asserted leases now run 30 s; the fence of a renewed one is kept.
    deadline, fence = r.hget(alive.key, f"o:{alive.owner}").split()
    assert int(fence) == alive.fence
    seconds, micros = r.time()
    assert int(deadline) - (seconds * 1000 + micros // 1000) > 20_000
    assert f"o:{vanished.owner}" in r.hgetall(vanished.key)
    assert f"o:{lost.owner}" not in r.hgetall(lost.key)


def test_a_renewal_after_the_release_does_not_bring_the_lease_back(
    gate: Gate, r: redis.Redis
) -> None:
    """The renewer copied the held leases, the run finished and released, and the renewal
    of the copy reached the store after the release: the lease stays released."""
    lease = Lease(gate, KEY, ttl=30)
    assert lease.acquire()
    assert lease.release()
    assert lease.renew() is False  # lost: released on purpose, not forgotten by the store
    assert owners(r) == {}
    assert Lease(gate, KEY).acquire()  # the next run gets the key at once


def test_a_renewal_queued_beside_the_release_on_another_connection_leaves_the_key_free(
    store_server: StoreServer, store: Store, r: redis.Redis
) -> None:
    """The race itself: the release and the renewal wait in two connections of a stalled
    store, the release sent first; whichever the server runs first, the key ends free.

    Each call is made by a thread of its own, as in a worker (the event loop releases, the
    renewer renews); each thread keeps its own connection, opened before the stall.
    """
    gate = Gate(store)
    lease = Lease(gate, KEY, ttl=30)
    assert lease.acquire()
    with ThreadPoolExecutor(1) as releaser, ThreadPoolExecutor(1) as renewer:
        # Both connected, both scripts loaded (a NOSCRIPT reply would re-send it later).
        assert releaser.submit(gate.release, [KEY], owner="nobody").result() == 0
        assert renewer.submit(store.scripts.call, "renew", [], []).result() == []
        store_server.pause()
        sent = threading.Event()

        def release() -> int:
            keys, args = Release((KEY,), lease.owner).script_call(gate.notice_channel)
            pending = store.scripts.send("release", keys, args)
            sent.set()  # in the store's socket (a thread late on a loaded machine is waited for)
            return int(store.scripts.result(pending))

        try:
            released = releaser.submit(release)
            assert sent.wait(10)
            time.sleep(0.1)  # (the kernel has it: written before the event was set)
            renewed = renewer.submit(lease.renew)
            time.sleep(0.3)
        finally:
            store_server.resume()
        assert released.result(timeout=10) == 1
        # The release was in the store's socket first; the server usually runs it first,
        # and the renewal then finds the lease gone (False). Three loaded CI rehearsals
        # saw the server pick the renewal's connection first after SIGCONT (True: renewed,
        # then released). Either order must leave the key free: a renewal never brings
        # back a lease its owner released.
        renewed.result(timeout=10)
    assert owners(r) == {}
    assert Lease(gate, KEY).acquire()


def test_a_lease_its_run_freed_at_the_body_end_is_ended_for_its_renewer_not_lost(
    gate: Gate, r: redis.Redis
) -> None:
    """Issue 34 (e): the run's pool process frees its leases as the body ends, while its
    worker's main process, which has not heard of the end (its consumer reconnecting to
    the broker), still renews them. The key is free at once; the renewer reads ENDED,
    drops the lease and reports no loss; the worker's own release later takes the mark
    away; a mark past its time is swept by the next grant of the key."""
    lease = Lease(gate, KEY, ttl=30)
    assert lease.acquire()
    lost: list[tuple[str, str]] = []
    book = LeaseBook(gate, interval=10, on_lost=lambda owner, key: lost.append((owner, key)))
    book.add(lease.owner, [HeldLease(KEY, lease.owner, 1, 30, lease.epoch)])

    assert gate.release_many([Release((KEY,), lease.owner, ended_mark=60.0)]) == [1]
    assert owners(r) == {}
    other = Lease(gate, KEY, ttl=30)
    assert other.acquire()  # the key is free at the body's end
    assert gate.renew([HeldLease(KEY, lease.owner, 1, 30, lease.epoch)])[0].status == ENDED
    book.renew_now()
    assert lost == [] and book.losses == 0
    assert book.held() == []  # no longer renewed
    assert owners(r) == {other.owner: r.hget(KEY, f"o:{other.owner}")}  # not written back

    # The main process hears of the end: its release frees nothing and takes the mark.
    assert f"x:{lease.owner}" in r.hgetall(KEY)
    assert gate.release([KEY], owner=lease.owner) == 0
    assert f"x:{lease.owner}" not in r.hgetall(KEY)

    # A worker that died before its release leaves the mark; it goes when it is past.
    third = Lease(gate, "baton:{t}:ex:m", ttl=30)
    assert third.acquire()
    assert gate.release_many([Release((third.key,), third.owner, ended_mark=0.2)]) == [1]
    assert f"x:{third.owner}" in r.hgetall(third.key)
    time.sleep(0.3)
    assert Lease(gate, third.key, ttl=30).acquire()
    assert f"x:{third.owner}" not in r.hgetall(third.key)


def test_a_lease_its_run_freed_without_a_mark_is_its_release_by_the_shared_table(
    gate: Gate, r: redis.Redis
) -> None:
    """The same end, told through the worker's shared table (core/shared_ends) instead of
    a mark in the store: the run's process said ENDING, then freed its lease; the renewer
    reads LOST, asks the table, drops the lease and reports nothing; a lease the store
    forgot is not written back for that run (given back if it was)."""
    ends = SharedEnds()
    lease = Lease(gate, KEY, ttl=30)
    assert lease.acquire()
    lost: list[tuple[str, str]] = []
    book = LeaseBook(
        gate, interval=10, on_lost=lambda o, k: lost.append((o, k)), ending=ends.ending
    )
    book.add(lease.owner, [HeldLease(KEY, lease.owner, 1, 30, lease.epoch)])
    ends.set(lease.owner, ENDING)
    assert gate.release_many([Release((KEY,), lease.owner)]) == [1]
    assert f"x:{lease.owner}" not in r.hgetall(KEY)  # nothing left for anyone to clear
    book.renew_now()
    book.renew_now()  # (a loss would be reported here)
    assert lost == [] and book.losses == 0
    assert book.held() == []
    assert owners(r) == {}


def test_an_ended_mark_keeps_a_key_that_held_nothing_else(gate: Gate, r: redis.Redis) -> None:
    """A key whose only field was the lease (no fence: a concurrency slot) keeps an
    expiry of its own once marked, not forever."""
    lease = Lease(gate, "baton:{t}:cc:slots", ttl=30, limit=3)
    assert lease.acquire()
    r.persist(lease.key)
    assert gate.release_many([Release((lease.key,), lease.owner, ended_mark=5.0)]) == [1]
    assert 0 < r.pttl(lease.key) <= 5000


def test_an_unlocked_or_expired_lease_is_not_written_back(
    gate: Gate, store: Store, r: redis.Redis
) -> None:
    unlocked = Lease(gate, KEY, ttl=30)
    assert unlocked.acquire()
    assert store_inspect.unlock(store, KEY, force=True, channel="baton:released")[0] == 1
    assert unlocked.renew() is False
    assert owners(r) == {}

    # (A lease that expired but is still there is extended: no run was granted its key
    # since, as a grant removes the expired leases it finds.)
    expired = Lease(gate, "baton:{t}:ex:e", ttl=0.2)
    assert expired.acquire()
    # Nobody renews it: it expires (ttl 0.2 s), and its key with it.
    wait_until(lambda: not r.exists(expired.key), 3.5, "the expired lease's key gone")
    assert expired.renew() is False
    assert not r.exists(expired.key)
    assert Lease(gate, expired.key).acquire()


def test_leases_the_store_forgot_are_written_back_by_their_holders() -> None:
    """A store restarted empty: each live holder's renewal re-asserts its lease (two
    leases of one family, one of another) and takes the store's new epoch, under which a
    renewal after its release is lost again."""
    server = StoreServer(name="forgetful", persistent=False)
    server.start()
    store = connect(server.url(), socket_timeout=5)
    gate = Gate(store)
    try:
        a = Lease(gate, "baton:{t}:ex:a", ttl=30)
        b = Lease(gate, "baton:{t}:ex:b", ttl=30)
        c = Lease(gate, "baton:{u}:cc:c", ttl=30, limit=2)
        assert a.acquire() and b.acquire() and c.acquire()
        first_epoch = a.epoch
        assert first_epoch and b.epoch == first_epoch

        server.restart()  # empty: no persistence
        with server.client() as plain:
            assert plain.dbsize() == 0
        book = LeaseBook(gate, interval=10)
        for lease in (a, b, c):
            book.add(
                lease.owner, [HeldLease(lease.key, lease.owner, lease.limit, 30)], epoch=lease.epoch
            )
        for _ in range(3):  # the first call may find its connection closed by the restart
            try:
                book.renew_now()
                break
            except StoreUnavailable:
                continue
        assert book.renewals == 3 and book.losses == 0
        with server.client() as plain:
            for lease in (a, b, c):
                assert list(owners(plain, lease.key)) == [lease.owner]
        assert not Lease(gate, a.key).acquire()  # a live run holds it again

        # The holders renew under the store's new epoch now: after a release, a late
        # renewal is lost again instead of bringing the lease back.
        (held_a,) = book.remove(a.owner)
        assert held_a.epoch not in ("", first_epoch)
        assert a.release()
        assert [x.status for x in gate.renew([held_a])] == [0]
        assert Lease(gate, a.key).acquire()
    finally:
        store.client.close()
        server.close()


def test_a_lease_written_back_for_a_run_that_finished_meanwhile_is_given_back(
    gate: Gate, store: Store, r: redis.Redis
) -> None:
    """The store forgot, and the run finished while the renewal of its copy was on its
    way: the renewal re-asserts the lease, and the book gives it back at once."""
    lease = Lease(gate, KEY, ttl=30)
    assert lease.acquire()
    book = LeaseBook(gate, interval=10)
    book.add(lease.owner, [HeldLease(KEY, lease.owner, 1, 30)], epoch=lease.epoch)
    r.flushall()  # the store forgets

    class FinishingGate(Gate):
        """The run finishes (leaves the book) between the copy and the renewal call."""

        def renew(self, leases: Sequence[HeldLease]) -> list[Renewal]:
            book.remove(lease.owner)
            return super().renew(leases)

    book.gate = FinishingGate(store)
    book.renew_now()
    assert book.losses == 0
    assert owners(r) == {}
    assert Lease(gate, KEY).acquire()


def test_lease_book_keeps_a_lease_alive_past_its_ttl(gate: Gate, r: redis.Redis) -> None:
    lease = Lease(gate, KEY, ttl=1.0)
    assert lease.acquire()
    book = LeaseBook(gate, interval=0.2)
    book.add(lease.owner, [HeldLease(KEY, lease.owner, 1, 1.0)])
    book.start()
    try:
        time.sleep(3.2)  # over 3 x ttl
        assert not Lease(gate, KEY).acquire()
        assert book.renewals >= 3 and book.losses == 0
    finally:
        book.stop()
    assert book.remove(lease.owner)
    time.sleep(1.3)  # nobody renews now: it expires
    assert Lease(gate, KEY).acquire()


def _book_holding_a_lost_lease(
    gate: Gate,
) -> tuple[LeaseBook, Lease, list[tuple[str, str]]]:
    """A book that still holds a lease which expired and another owner took; the
    losses its ``on_lost`` was told of."""
    lease = Lease(gate, KEY, ttl=0.2)
    assert lease.acquire()
    time.sleep(0.3)
    assert Lease(gate, KEY, ttl=30).acquire()
    lost: list[tuple[str, str]] = []
    book = LeaseBook(gate, interval=10, on_lost=lambda owner, key: lost.append((owner, key)))
    book.add(lease.owner, [HeldLease(KEY, lease.owner, 1, 30)])
    return book, lease, lost


def test_lease_book_reports_a_lost_lease(gate: Gate) -> None:
    book, lease, lost = _book_holding_a_lost_lease(gate)
    book.renew_now()
    assert lost == []  # reported at the next pass, if its run still goes on
    book.renew_now()
    assert lost == [(lease.owner, KEY)]
    assert book.losses == 1
    book.renew_now()
    assert book.losses == 1  # one incident, one report


def test_a_lost_lease_whose_run_ended_before_the_next_pass_is_not_reported(
    gate: Gate,
) -> None:
    """The store stalled past the lease's deadline while its run ended; the run's pool
    process was still sending its release when the renewal came back "lost". Its end
    reaches the book before the next pass: no loss to report."""
    book, lease, lost = _book_holding_a_lost_lease(gate)
    book.renew_now()
    book.remove(lease.owner)  # the worker hears of the run's end
    book.renew_now()
    assert lost == [] and book.losses == 0


def test_lease_book_keeps_a_running_tasks_unique_claim_and_never_brings_it_back(
    gate: Gate, r: redis.Redis
) -> None:
    """A run of an expiring message holds its unique claim while it lives (renewed with
    its leases); a renewal never re-creates a claim that was freed, nor touches another
    task id's; once nobody renews it, the claim lapses within its ttl."""
    key = "baton:{t}:uq:k"
    r.set(key, "id-1", px=1000)
    book = LeaseBook(gate, interval=0.2)
    book.add("id-1|w|1", [], claim=HeldClaim(key, "id-1", 1.0, expires_at=0.0))
    book.start()
    try:
        time.sleep(2.5)  # over twice its ttl
        assert r.get(key) == "id-1"
    finally:
        book.stop()
    assert 0 < r.pttl(key) <= 1000

    r.delete(key)  # freed (the run finished): a late renewal must not write it back
    assert gate.keep_claims([HeldClaim(key, "id-1", 1.0, 0.0)], time.time()) == [False]
    assert r.get(key) is None
    r.set(key, "id-2")  # a later publish's claim is never touched
    assert gate.keep_claims([HeldClaim(key, "id-1", 1.0, 0.0)], time.time()) == [False]
    assert r.ttl(key) == -1

    # An expiry further away than the ttl holds the claim until then.
    r.set(key, "id-3", px=100)
    assert gate.keep_claims([HeldClaim(key, "id-3", 1.0, time.time() + 30)], time.time()) == [True]
    assert 25_000 < r.pttl(key) <= 30_000
