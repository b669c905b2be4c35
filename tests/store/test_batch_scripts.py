"""The batching scripts against a real server, step by step (core/batch.py): what each
worker's tick is told, and what the store keeps (issue 37)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from celery_baton.core.batch import Batches, Claim, KeyTick, TickReply
from celery_baton.core.keys import KeyNames
from celery_baton.store.connection import Store, connect

LONG = 60.0  # a presence / run lease that does not lapse within a test


@pytest.fixture
def store(store_url: str) -> Iterator[Store]:
    store = connect(store_url, socket_timeout=2)
    yield store
    store.client.close()


@pytest.fixture
def batches(store: Store, request: pytest.FixtureRequest) -> Batches:
    batches = Batches(store, KeyNames(f"bt-{request.node.name[:40]}"))
    # No grace for the key (a test server may be younger than the run ttl used here).
    store.client.set(batches.keys("t", "k")[8], 0)
    return batches


def tick(
    batches: Batches,
    worker: str,
    *,
    new: list[str] = (),  # type: ignore[assignment]
    size: int = 3,
    wait: float = LONG,
    run: str = "",
    held: list[str] | None = None,
    presence: float = LONG,
    most: int = 1,
) -> TickReply:
    keys = batches.keys("t", "k")
    encoded = [(i, f'[[], {{"n": "{i}"}}]') for i in new]
    runs = [run] if run else []
    t = KeyTick(keys, size, wait, run_ttl=presence, runs=runs, new=encoded, held=held, most=most)
    (reply,) = batches.tick(worker, presence, [t])
    return reply


def claimed(reply: TickReply) -> Claim | None:
    """The batch a tick that may claim one claimed (None: none)."""
    assert len(reply.claims) <= 1, reply.claims
    return reply.claims[0] if reply.claims else None


def test_a_batch_is_claimed_when_full_by_a_worker_holding_one_of_its_calls(
    batches: Batches,
) -> None:
    reply = tick(batches, "w1", new=["a", "b"], size=10)
    assert claimed(reply) is None and reply.due is not None and reply.due > 1
    # Full, but w3 holds neither of the first two: it claims nothing; w1 does.
    assert claimed(tick(batches, "w3", new=["c", "d"], size=2)) is None
    claim = claimed(tick(batches, "w1", size=2))
    assert claim is not None
    assert claim.carrier == "a"
    assert [call_id for call_id, _ in claim.calls] == ["a", "b"]  # the oldest first
    assert claim.calls[0][1] == '[[], {"n": "a"}]'
    # Batches of one key run side by side: w3 claims the next one while w1's runs.
    second = claimed(tick(batches, "w3", size=1))
    assert second is not None and [i for i, _ in second.calls] == ["c"]


def test_a_tick_claims_as_many_due_batches_as_it_may_each_carried_by_a_call_it_holds(
    batches: Batches,
) -> None:
    tick(batches, "w1", new=["a", "b", "c", "d", "e", "f", "g"], size=10)
    reply = tick(batches, "w1", size=2, most=3)
    assert [[i for i, _ in c.calls] for c in reply.claims] == [["a", "b"], ["c", "d"], ["e", "f"]]
    assert [c.carrier for c in reply.claims] == ["a", "c", "e"]
    assert len({c.run for c in reply.claims}) == 3
    assert reply.due is not None and reply.due > 1  # g alone waits for its batch_wait
    assert tick(batches, "w1", size=2, most=3).claims == []
    # A batch none of whose calls this worker holds ends its claims: its holder's turn.
    tick(batches, "w2", new=["h", "i"], size=10)
    tick(batches, "w1", new=["j"], size=10)

    def claims(worker: str) -> list[list[str]]:
        return [[i for i, _ in c.calls] for c in tick(batches, worker, size=1, most=5).claims]

    assert claims("w1") == [["g"]]
    assert claims("w2") == [["h"], ["i"]]
    assert claims("w1") == [["j"]]


def test_a_partial_batch_is_due_after_the_wait(batches: Batches) -> None:
    reply = tick(batches, "w1", new=["a"], wait=0.3)
    assert claimed(reply) is None and reply.due is not None and 0.1 < reply.due <= 0.3
    time.sleep(0.35)
    claim = claimed(tick(batches, "w1", wait=0.3))
    assert claim is not None and [i for i, _ in claim.calls] == ["a"]


def test_done_calls_are_told_to_their_holders_and_a_later_copy_is_finished(
    batches: Batches,
) -> None:
    tick(batches, "w1", new=["a"], size=10)
    tick(batches, "w2", new=["b", "c"], size=10)
    claim = claimed(tick(batches, "w1", size=3))
    assert claim is not None
    keys = batches.keys("t", "k")
    batches.done(keys, claim.run, ["a", "b", "c"], keep=LONG)
    assert sorted(tick(batches, "w2").finished) == ["b", "c"]
    assert tick(batches, "w2").finished == []  # told once
    # A message of a done call delivered again (its holder died before acking it).
    assert tick(batches, "w3", new=["b"]).finished == ["b"]
    assert tick(batches, "w3", held=["b"]).finished == ["b"]
    # The key's run is free: the next batch can start.
    claim = claimed(tick(batches, "w3", new=["d"], size=1))  # claimed in the same tick
    assert claim is not None and claim.carrier == "d"


def test_a_run_whose_lease_lapsed_gives_its_calls_back(batches: Batches) -> None:
    tick(batches, "w1", new=["a", "b"], presence=0.2, size=10)
    claim = claimed(tick(batches, "w1", size=2, presence=0.2))
    assert claim is not None
    tick(batches, "w2", new=["c"])
    time.sleep(0.3)
    # w1 is gone (its run not renewed): w2 sees a, b wait again, w1's (gone) holder is
    # dropped at w2's full check: their messages come back from the broker.
    reply = tick(batches, "w2", size=1, held=["c"])
    assert claimed(reply) is not None
    assert [i for i, _ in claimed(reply).calls] == ["c"]


def test_a_renewed_run_keeps_its_calls(batches: Batches, store: Store) -> None:
    tick(batches, "w1", new=["a", "b"], presence=0.4, size=10)
    claim = claimed(tick(batches, "w1", size=2, presence=0.4))
    assert claim is not None
    for _ in range(4):
        time.sleep(0.15)
        tick(batches, "w1", size=2, run=claim.run, presence=0.4)
    keys = batches.keys("t", "k")
    tick(batches, "w2", size=1, held=[])  # a lapsed run would be given back here
    assert store.client.zcard(keys[0]) == 0
    assert store.client.hlen(keys[4]) == 2  # still w1's run's


def test_calls_the_store_forgot_are_missing_at_the_full_check(
    batches: Batches, store: Store
) -> None:
    tick(batches, "w1", new=["a", "b"])
    for key in batches.keys("t", "k"):
        store.client.delete(key)
    reply = tick(batches, "w1", held=["a", "b"])
    assert sorted(reply.missing) == ["a", "b"]
    assert tick(batches, "w1").missing == []  # only a full check looks


def test_the_end_of_a_run_that_did_not_finish_gives_back_all_but_its_carrier(
    batches: Batches,
) -> None:
    tick(batches, "w1", new=["a", "b"], size=10)
    claim = claimed(tick(batches, "w1", size=2))
    assert claim is not None and claim.carrier == "a"
    batches.end(batches.keys("t", "k"), claim.run, claim.carrier)
    reply = tick(batches, "w1", size=1, held=["b"])
    assert claimed(reply) is not None
    assert [i for i, _ in claimed(reply).calls] == ["b"]  # the carrier's call is Celery's


def test_a_key_first_seen_by_a_server_up_longer_than_a_run_ttl_has_no_grace(
    batches: Batches, store: Store
) -> None:
    keys = batches.keys("t", "k")
    store.client.delete(keys[8])
    time.sleep(0.6)  # the server is up for longer than the run ttl below
    reply = tick(batches, "w1", new=["a"], size=1, presence=0.5)
    assert claimed(reply) is not None
    epoch = store.client.get(keys[8])
    grace = (epoch.decode() if isinstance(epoch, bytes) else str(epoch)).split()[0]
    assert grace == "0"  # "<grace> <replication id>"


def test_a_batch_whose_done_marker_the_store_lost_is_done_again_by_its_runner(
    batches: Batches, store: Store
) -> None:
    """A failover to a replica that lacked the done marker (the pool process wrote it on
    the old master): the runner's end says the body returned, and its full checks say it
    again for a run ttl; each holder hears its call ran, none is claimed again."""
    keys = batches.keys("t", "k")
    tick(batches, "w1", new=["a", "b"], size=10)
    tick(batches, "w2", new=["c"], size=10)
    claim = claimed(tick(batches, "w1", size=3))
    assert claim is not None
    # batch_done never reached this store: the run ends with its calls given as done.
    batches.end(keys, claim.run, claim.carrier, ["a", "b", "c"], keep=LONG)
    assert store.client.zcard(keys[0]) == 0 and store.client.hlen(keys[4]) == 0
    assert set(tick(batches, "w2", held=["c"]).finished) == {"c"}
    # The calls lost again (registered again by their holders): the full check of the
    # runner marks them done once more.
    store.client.delete(keys[5])
    tick(batches, "w1", new=["b"], size=1, held=["b"])
    tick(batches, "w2", new=["c"], size=1, held=["c"])
    again = KeyTick(keys, 1, LONG, held=["b"], done=["a", "b", "c"], keep=LONG)
    (reply,) = batches.tick("w1", LONG, [again])
    assert claimed(reply) is None and "b" in reply.finished
    assert store.client.zcard(keys[0]) == 0
    assert set(tick(batches, "w2", held=["c"]).finished) == {"c"}


def test_a_run_the_store_forgot_is_written_back_and_not_claimed_twice(
    batches: Batches, store: Store
) -> None:
    keys = batches.keys("t", "k")
    tick(batches, "w1", new=["a", "b"], size=10)
    claim = claimed(tick(batches, "w1", size=2))
    assert claim is not None
    for key in keys:
        store.client.delete(key)
    # As if the server had just started: a grace until its start + one run ttl.
    store.client.set(keys[8], int(time.time() * 1000) + 5000)
    # The holders register their calls again; nobody may claim them meanwhile.
    reply = tick(batches, "w2", new=["a", "b"], size=1, held=[])
    assert claimed(reply) is None and reply.due is not None and reply.due > 1
    # The runner writes its run back at its full check.
    calls = [(claim.run, "a"), (claim.run, "b")]
    keys_tick = KeyTick(keys, 1, LONG, runs=[claim.run], run_calls=calls, held=[])
    batches.tick("w1", LONG, [keys_tick])
    assert store.client.zscore(keys[6], claim.run) is not None
    assert store.client.zcard(keys[0]) == 0  # none waits: both are the run's
    batches.done(keys, claim.run, ["a", "b"], keep=LONG)
    assert set(tick(batches, "w2", held=["a", "b"]).finished) == {"a", "b"}


def test_a_lapsed_run_among_several_gives_back_only_its_own_calls(
    batches: Batches, store: Store
) -> None:
    tick(batches, "w1", new=["a"], size=10, presence=0.3)
    tick(batches, "w2", new=["c"], size=10)
    first = claimed(tick(batches, "w1", size=1, presence=0.3))
    second = claimed(tick(batches, "w2", size=1))
    assert first is not None and second is not None
    time.sleep(0.4)  # w1's run lapses; w2's lease is long
    tick(batches, "w2", size=10, held=["c"], run=second.run)
    keys = batches.keys("t", "k")
    ids = {k.decode() if isinstance(k, bytes) else k for k in store.client.hkeys(keys[4])}
    assert ids == {"c"}
    # w1's call went back to the waiting ones (then dropped: its holder w1 is gone).
    assert store.client.zscore(keys[0], "a") is None


def test_calls_a_worker_holds_no_more_leave_unless_another_holds_them_now(
    batches: Batches, store: Store
) -> None:
    keys = batches.keys("t", "k")
    tick(batches, "w1", new=["a", "b"], size=10)
    tick(batches, "w2", new=["b"], size=10)  # b delivered again, to w2 (w1's connection lost)
    reply = batches.tick("w1", LONG, [KeyTick(keys, 10, LONG, gone=["a", "b"])])[0]
    assert claimed(reply) is None
    members = store.client.zrange(keys[0], 0, -1)
    waiting = {m.decode() if isinstance(m, bytes) else m for m in members}
    assert waiting == {"b"}  # a left; b is w2's


def test_a_copy_of_a_done_call_keeps_its_done_marker_for_another_retention(
    batches: Batches,
) -> None:
    """Each copy of a done call that a tick sees (registered again, or held at a full
    check) keeps the call's done marker for the tick's retention from then: a copy whose
    ack fails again comes back later still, and must find it (the soak's seed 263512648:
    a call ran in a second batch 54 s after the first, past a marker kept from its end)."""
    keys = batches.keys("t", "k")
    tick(batches, "w1", new=["a"], size=10)
    claim = claimed(tick(batches, "w1", size=1))
    assert claim is not None
    batches.done(keys, claim.run, ["a"], keep=1.0)  # remembered 1 s from the run's end
    t = KeyTick(keys, 10, LONG, run_ttl=LONG, new=[("a", '[[], {"n": "a"}]')], keep=LONG)
    (reply,) = batches.tick("w2", LONG, [t])
    assert reply.finished == ["a"]  # the copy is acked as done, and the marker kept again
    time.sleep(1.5)  # past the first retention
    tick(batches, "w4", held=[])  # a full check: markers past their retention go
    assert tick(batches, "w3", new=["a"]).finished == ["a"]  # another copy, later still


def test_a_call_its_holder_leaves_keeps_the_claim_of_the_batch_that_runs_it(
    batches: Batches, store: Store
) -> None:
    """w2 claims a batch with w1's calls; w1 then leaves them (its broker connection was
    lost) and registers them again in the same tick (its reconnect took them back). The
    claim stays: the copies are not waiting, no batch claims them again, and they are
    finished when the batch ends (the nemesis soak's seed 310867550: a leave dropped the
    claim, the calls waited again and ran in a second batch while the first ran)."""
    keys = batches.keys("t", "k")
    tick(batches, "w1", new=["a", "b"], size=10)
    tick(batches, "w2", new=["c"], size=10)
    claim = claimed(tick(batches, "w2", size=3))
    assert claim is not None and {i for i, _ in claim.calls} == {"a", "b", "c"}
    again = [("a", '[[], {"n": "a"}]'), ("b", '[[], {"n": "b"}]')]
    batches.tick("w1", LONG, [KeyTick(keys, 3, LONG, new=again, gone=["a", "b"])])
    assert store.client.zcard(keys[0]) == 0  # none waits: they are the running batch's
    check = tick(batches, "w1", size=1, held=["a", "b"])  # a full check
    assert claimed(check) is None
    if check.missing:  # what a worker does with calls the store does not know
        assert claimed(tick(batches, "w1", new=check.missing, size=1)) is None
    assert store.client.zcard(keys[0]) == 0
    batches.done(keys, claim.run, ["a", "b", "c"], keep=LONG)
    assert sorted(tick(batches, "w1", held=["a", "b"]).finished) == ["a", "b"]
