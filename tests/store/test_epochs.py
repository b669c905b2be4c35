"""The store epochs in the gate script (gate.lua, kinds "G" and "E"): a grant that
passed them keeps the family's epoch for a second on this server ("<E's key>:here",
never replicated), so the grants of that second read neither epoch key nor INFO, and
the answers are the ones the epoch keys give: the same epoch, the same grace."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis

from celery_baton.core.conditions import StoreGrace, TakeLease
from celery_baton.core.gate import Gate, HeldLease
from celery_baton.core.keys import KeyNames, epoch_key
from celery_baton.store.connection import connect
from tests.support.servers import StoreServer

NAMES = KeyNames()
CONC = "baton:{t}:cc:k"
EX = "baton:{t}:ex:a"
EX2 = "baton:{t}:ex:b"


@pytest.fixture
def gate(store_url: str) -> Iterator[Gate]:
    """A gate as a worker's on one server: with the store-wide epoch (the grace)."""
    store = connect(store_url, socket_timeout=2)
    yield Gate(store, grace_key=NAMES.store_epoch)
    store.client.close()


def calls(r: redis.Redis) -> tuple[int, int]:
    """GET and INFO commands the server ran since its counters were reset (scripts'
    included; read in one INFO, which counts itself only after it answered)."""
    stats = r.info("commandstats")

    def count(command: str) -> int:
        return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))

    return count("get"), count("info")


def test_a_familys_grants_within_a_second_read_neither_epoch_key_nor_info(
    gate: Gate, r: redis.Redis
) -> None:
    first = gate.decide([TakeLease(CONC, limit=5)], owner="a|w|1")
    assert first.granted and first.epoch == r.get(NAMES.epoch("t"))
    assert r.get(f"{NAMES.epoch('t')}:here") == first.epoch
    assert 0 < r.pttl(f"{NAMES.epoch('t')}:here") <= 1000

    r.config_resetstat()
    second = gate.decide([TakeLease(CONC, limit=5)], owner="b|w|1")
    once = gate.decide([TakeLease(EX)], owner="c|w|1")  # another key, same family
    assert second.granted and once.granted and second.epoch == once.epoch == first.epoch
    # One GET each (the verified epoch); neither the store-wide nor the family epoch.
    assert calls(r) == (2, 0)
    # A key used once keeps no field of its own: it vanishes with its release.
    assert gate.release([EX], owner="c|w|1") == 1 and not r.exists(EX)

    time.sleep(1.1)  # the verified epoch lapsed: this server looks again
    r.config_resetstat()
    third = gate.decide([TakeLease(CONC, limit=5)], owner="d|w|1")
    assert third.granted and third.epoch == first.epoch
    assert calls(r) == (3, 1)  # GETs: here, G, E


def test_the_grace_holds_beside_a_lease_a_renewal_wrote_back(
    gate: Gate, store_server: StoreServer
) -> None:
    """The store forgot everything; one holder's renewal writes its lease back and the
    family's epoch with it. A new lease on another key of that family must still wait
    for the grace (the family epoch exists again, the store-wide one does not)."""
    held = gate.decide([TakeLease(CONC, limit=5)], owner="a|w|1")
    gate.decide([TakeLease(CONC, limit=5)], owner="b|w|1")
    other = gate.decide([TakeLease(EX2)], owner="c|w|1")
    assert held.granted and other.granted

    store_server.restart_empty()  # a restart without persistence
    gate.store.client.close()
    gate = Gate(connect(store_server.url(0), socket_timeout=2), grace_key=NAMES.store_epoch)
    (renewal,) = gate.renew([HeldLease(CONC, "a|w|1", 5, 30, held.epoch)])
    assert renewal.status == 2 and renewal.epoch not in ("", held.epoch)  # re-asserted

    # c's lease on EX2 is forgotten and c has not renewed yet: nobody may take EX2.
    late = gate.decide([TakeLease(EX2)], owner="d|w|1")
    assert not late.granted and late.denied_by is not None
    # Until the server's start + ttl (10 s): its uptime, rounded down, is under a second.
    assert isinstance(late.denied_by, StoreGrace) and 8 < late.retry_after <= 10
    busy = gate.decide([TakeLease(CONC, limit=5)], owner="e|w|1")
    assert (
        not busy.granted and busy.denied_by is not None and isinstance(busy.denied_by, StoreGrace)
    )


def test_a_call_takes_the_epoch_of_its_first_lease_keys_family(gate: Gate, r: redis.Redis) -> None:
    """Keys without a hash tag are families of their own: a call's epoch is its first
    lease key's family's, and another family's verified epoch is left as it is."""
    alone = gate.decide([TakeLease("k2", limit=5)], owner="a|w|1")
    assert alone.granted and alone.epoch == r.get(epoch_key("k2"))

    both = [TakeLease("k1", limit=5), TakeLease("k2", limit=5)]
    for owner in ("c|w|1", "d|w|1"):
        decision = gate.decide(both, owner=owner)
        assert decision.granted and decision.epoch == r.get(epoch_key("k1"))
    assert r.get(f"{epoch_key('k1')}:here") == r.get(epoch_key("k1"))
    assert r.get(f"{epoch_key('k2')}:here") == alone.epoch


def test_no_grace_on_a_store_up_longer_than_a_ttl(gate: Gate, r: redis.Redis) -> None:
    """No store-wide epoch on a server up longer than the ttl: every lease granted before
    it started has run out, so none is missing; the first lease is granted at once. The
    grace's start is the server's (its uptime less the second that the server's count
    may add), written for the next."""
    while int(r.info("server")["uptime_in_seconds"]) < 3:
        time.sleep(0.2)
    r.delete(NAMES.store_epoch, f"{NAMES.epoch('t')}:here")
    up = int(r.info("server")["uptime_in_seconds"])
    decision = gate.decide([TakeLease(EX)], owner="a|w|1", ttl=1.0)
    assert decision.granted
    since = int(str(r.get(NAMES.store_epoch)).split()[0])
    now_ms = int(r.time()[0]) * 1000
    assert now_ms - up * 1000 <= since <= now_ms - (up - 1) * 1000 + 1000
    # A task (another family) with a longer lease_ttl waits until the start + its ttl.
    long = gate.decide([TakeLease("baton:{u}:ex:b")], owner="b|w|1", ttl=up + 20)
    assert (
        not long.granted and long.denied_by is not None and isinstance(long.denied_by, StoreGrace)
    )
    assert 18 < long.retry_after <= 22
