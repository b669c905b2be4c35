"""The gate's calls and replies, without a store: what ``gate.py`` sends the scripts
(gate.lua, release.lua) and how it reads their answers. The scripts themselves are
tested against a real server in tests/store/test_gate.py."""

from __future__ import annotations

import pytest

from celery_baton.core.conditions import (
    FairPart,
    FairTurn,
    FreeUnique,
    KeepUnique,
    NotDone,
    NotSuperseded,
    Override,
    Penalty,
    PublishOrder,
    Rate,
    StoreGrace,
    TakeLease,
    WeightedRate,
    encode,
)
from celery_baton.core.gate import Release, gate_call, owner_task_id, parse_decision

RATE = Rate("baton:{t}:rate", 1_000, 2)
EX = TakeLease("baton:{t}:ex:k", fence=True)
CONC = TakeLease("baton:{t}:cc", limit=3)
GRACE = "baton:epoch"


def test_a_call_lists_owner_ttl_reservation_then_three_values_per_condition() -> None:
    keys, args = gate_call([RATE], "id|w|1", ttl=2.5, reserve=0.25)
    assert keys == ["baton:{t}:rate"]
    assert args == ["id|w|1", 2500, 250_000, "R", "1000", "2"]


def test_a_lease_adds_its_familys_epoch_and_the_grace_keys_past_the_conditions() -> None:
    keys, args = gate_call([RATE, EX, CONC], "id|w|1", ttl=30, grace_key=GRACE)
    assert keys == ["baton:{t}:rate", "baton:{t}:ex:k", "baton:{t}:cc", "baton:{t}:epoch", GRACE]
    assert args[3:] == ["R", "1000", "2", "L", "1", "1", "L", "3", "0"]  # no argument more


def test_no_lease_no_epoch_and_no_grace_key_no_grace() -> None:
    assert gate_call([RATE], "o", 1, grace_key=GRACE)[0] == ["baton:{t}:rate"]
    keys, _ = gate_call([EX], "o", 1)
    assert keys == ["baton:{t}:ex:k", "baton:{t}:epoch"]


def test_each_kind_is_written_as_gate_lua_reads_it() -> None:
    """The wire format of every kind (gate.lua's header): a letter and two values."""
    assert encode(TakeLease("k")) == ("L", "1", "0")
    assert encode(TakeLease("k", limit=4, fence=True)) == ("L", "4", "1")
    assert encode(Rate("k", 1_000, 2)) == ("R", "1000", "2")
    assert encode(WeightedRate("k", 3_000, 9_000)) == ("W", "3000", "9000")
    assert encode(Penalty("k")) == ("P", "", "")
    assert encode(Override("k", "rate")) == ("O", "rate", "")
    assert encode(NotDone("k", "5eed", "id-1")) == ("D", "5eed@0", "id-1")
    assert encode(NotDone("k", "5eed", "id-1", 2)) == ("D", "5eed@2", "id-1")
    assert encode(NotDone("k")) == ("D", "@0", "")
    assert encode(PublishOrder("k", 17, "id-1")) == ("S", "17", "id-1")
    assert encode(PublishOrder("k", None, "id-1")) == ("S", "", "id-1")
    assert encode(NotSuperseded("k", 60)) == ("N", "60000", "")
    assert encode(FreeUnique("k", "id-1")) == ("U", "id-1", "")
    assert encode(KeepUnique("k", "id-1", 0.0001)) == ("K", "id-1", "1")  # never 0 ms
    assert encode(FairTurn("k", "d1g", 500, 6000)) == ("F", "d1g", "500 0 6000")
    assert encode(FairTurn("k", "d1g", 500, 6000, more=True)) == ("F", "d1g", "500 1 6000")
    assert encode(FairPart("k:q")) == ("-", "", "")
    with pytest.raises(ValueError):
        encode(StoreGrace("k"))  # only ever in a denial


def test_a_ttl_never_rounds_to_zero() -> None:
    assert gate_call([RATE], "o", ttl=0.0001)[1][1] == 1


def test_a_grant_reads_fence_start_instant_and_epoch() -> None:
    decision = parse_decision([RATE, EX], [1, 7, 1_500_000, 1_700_000_000_000_000, "123"])
    assert decision.granted and decision.fence == 7 and decision.start_after == 1.5
    assert decision.at_us == 1_700_000_000_000_000 and decision.epoch == "123"


def test_a_denial_names_its_condition_holder_and_wait() -> None:
    decision = parse_decision([RATE, EX], [0, 2, 250_000, "other|w|9"])
    assert not decision.granted and decision.denied_by == EX
    assert decision.retry_after == 0.25 and decision.holder_task_id == "other"
    never = parse_decision([RATE], [0, 1, -1, "done-id"])
    assert never.retry_after == -1.0


def test_a_denial_past_the_callers_conditions_is_the_grace() -> None:
    decision = parse_decision([EX], [0, 3, 30_000_000, ""], grace_key=GRACE)
    assert decision.denied_by == StoreGrace(GRACE) and decision.retry_after == 30.0


def test_owner_task_id_is_the_part_before_the_first_bar() -> None:
    assert owner_task_id("a-b|host|3") == "a-b" and owner_task_id("plain") == "plain"


def test_a_release_adds_done_and_unique_keys_only_when_asked() -> None:
    bare = Release(("k1", "k2"), "id|w|1").script_call("chan")
    assert bare == (["k1", "k2"], ["id|w|1", 2, 0, "", "chan", 0])
    full = Release(("k1",), "id|w|1", "done", 0.0004, "uq", "id").script_call("chan")
    assert full == (["k1", "done", "uq"], ["id|w|1", 1, 1, "id", "chan", 0, ""])
    stamped = Release(("k1",), "id|w|1", "done", 1.0, done_stamp="5eed").script_call("chan")
    assert stamped == (["k1", "done"], ["id|w|1", 1, 1000, "", "chan", 0, "5eed"])
    kept = Release(("k1",), "id|w|1", unique_key="uq", unique_owner="id", unique_keep=21)
    assert kept.script_call("chan")[1][-1] == 21000  # the claim kept for a copy (ack failed)
    no_owner = Release(("k1",), "o", unique_key="uq").script_call("chan")
    assert no_owner[0] == ["k1"]
