"""The store epochs in the gate script (gate.lua, kinds "G" and "E"): a busy key keeps its
family's epoch ("_epoch", beside "_e"), so its grants read neither epoch key, and the
answers are the ones the epoch keys give: the same epoch, the same grace."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from celery_baton.gate import Condition, Gate, HeldLease
from celery_baton.keys import KeyNames, epoch_key
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


def gets(r: redis.Redis) -> int:
    """GET commands the server ran since its counters were reset (scripts' included)."""
    return int(r.info("commandstats").get("cmdstat_get", {}).get("calls", 0))


def test_a_busy_key_keeps_its_family_epoch_and_its_grants_read_no_epoch_key(
    gate: Gate, r: redis.Redis
) -> None:
    first = gate.decide([Condition.lease(CONC, limit=5)], owner="a|w|1")
    second = gate.decide([Condition.lease(CONC, limit=5)], owner="b|w|1")  # now busy
    assert first.epoch == second.epoch == r.get(NAMES.epoch("t"))
    assert r.hget(CONC, "_epoch") == first.epoch

    r.config_resetstat()
    third = gate.decide([Condition.lease(CONC, limit=5)], owner="c|w|1")
    assert third.granted and third.epoch == first.epoch
    # Neither the store-wide nor the family epoch was read: the one GET is the cached
    # replication id (gate.lua, replication_id).
    assert gets(r) == 1

    # A key used once keeps no field of its own: it vanishes with its release.
    once = gate.decide([Condition.lease(EX)], owner="d|w|1")
    assert once.epoch == first.epoch and r.hget(EX, "_epoch") is None
    assert gate.release([EX], owner="d|w|1") == 1 and not r.exists(EX)


def test_the_grace_holds_beside_a_lease_a_renewal_wrote_back(
    gate: Gate, store_server: StoreServer
) -> None:
    """The store forgot everything; one holder's renewal writes its lease back and the
    family's epoch with it. A new lease on another key of that family must still wait
    for the grace (the family epoch exists again, the store-wide one does not)."""
    held = gate.decide([Condition.lease(CONC, limit=5)], owner="a|w|1")
    gate.decide([Condition.lease(CONC, limit=5)], owner="b|w|1")
    other = gate.decide([Condition.lease(EX2)], owner="c|w|1")
    assert held.granted and other.granted

    store_server.forget()  # as after a restart without persistence
    (renewal,) = gate.renew([HeldLease(CONC, "a|w|1", 5, 30, held.epoch)])
    assert renewal.status == 2 and renewal.epoch not in ("", held.epoch)  # re-asserted

    # c's lease on EX2 is forgotten and c has not renewed yet: nobody may take EX2.
    late = gate.decide([Condition.lease(EX2)], owner="d|w|1")
    assert not late.granted and late.denied_by is not None
    assert late.denied_by.kind == "G" and 29 < late.retry_after <= 30
    busy = gate.decide([Condition.lease(CONC, limit=5)], owner="e|w|1")
    assert not busy.granted and busy.denied_by is not None and busy.denied_by.kind == "G"


def test_only_the_first_lease_key_lends_its_epoch(gate: Gate, r: redis.Redis) -> None:
    """Keys without a hash tag are families of their own: a busy key of another family in
    the same call neither gives the call its epoch nor takes the call's."""
    for owner in ("a|w|1", "b|w|1"):  # "k2" busy, under its own family's epoch
        gate.decide([Condition.lease("k2", limit=5)], owner=owner)
    own = r.hget("k2", "_epoch")
    assert own == r.get(epoch_key("k2"))

    both = [Condition.lease("k1", limit=5), Condition.lease("k2", limit=5)]
    for owner in ("c|w|1", "d|w|1"):  # "k1" busy now too
        decision = gate.decide(both, owner=owner)
        assert decision.granted and decision.epoch == r.get(epoch_key("k1"))
    assert r.hget("k1", "_epoch") == r.get(epoch_key("k1"))
    assert r.hget("k2", "_epoch") == own
