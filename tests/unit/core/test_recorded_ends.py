"""RecordedEnds (core/recorded_ends.py): which ends are kept, and that a write-back goes
on until the new master takes them. Pure logic: the writer is a list."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from celery_baton.core import recorded_ends
from celery_baton.core.gate import Release
from celery_baton.core.recorded_ends import RecordedEnds
from celery_baton.store.shards import UNKNOWN, ShardMaster, ShardMasters


def _end(n: int, done: bool = True) -> Release:
    return Release(
        ("baton:{t}:ex:k",),
        f"id{n}|w|1",
        f"baton:{{t}}:done:id{n}" if done else None,
        3600.0,
        "baton:{t}:uq:k",
        f"id{n}",
        done_stamp=f"s{n}",
        done_link="",
    )


def _wait_written(writes: list[list[Release]], n: int) -> None:
    deadline = time.monotonic() + 10
    while sum(map(len, writes)) < n and time.monotonic() < deadline:
        time.sleep(0.01)


def test_only_the_record_of_an_end_is_kept_and_written_back() -> None:
    writes: list[list[Release]] = []
    ends = RecordedEnds(lambda chunk: writes.append(list(chunk)), keep_for=60)
    ends.keep(_end(1))
    ends.keep(_end(2, done=False))  # nothing recorded: nothing to write again
    assert len(ends) == 1
    ends.write_back()
    _wait_written(writes, 1)
    [[written]] = writes
    # No lease and no unique claim given back twice: only the done record.
    assert written.lease_keys == () and written.unique_key is None
    assert (written.done_key, written.done_stamp, written.owner) == (
        "baton:{t}:done:id1",
        "s1",
        "id1|w|1",
    )


def test_ends_older_than_keep_for_are_dropped() -> None:
    ends = RecordedEnds(lambda chunk: None, keep_for=0.05)
    ends.keep(_end(1))
    time.sleep(0.1)
    ends.keep(_end(2))
    assert len(ends) == 1


def test_at_most_max_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(recorded_ends, "MAX_KEPT", 3)
    ends = RecordedEnds(lambda chunk: None, keep_for=60)
    for n in range(5):
        ends.keep(_end(n))
    assert len(ends) == 3


def test_a_write_back_goes_on_until_the_new_master_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(recorded_ends, "RETRY_EVERY", 0.01)
    tries: list[int] = []
    writes: list[list[Release]] = []

    def write(chunk: list[Release]) -> None:
        tries.append(1)
        if len(tries) < 4:
            raise ConnectionError("no master yet")
        writes.append(list(chunk))

    ends = RecordedEnds(write, keep_for=60)
    ends.keep(_end(1))
    ends.write_back()
    _wait_written(writes, 1)
    assert len(tries) == 4 and len(writes) == 1


def test_a_write_back_of_some_slots_writes_only_the_ends_kept_there() -> None:
    # Cluster: one shard's master changed; the ends on the other shards are where they
    # were, and a script call cannot span slots anyway.
    writes: list[list[Release]] = []
    shards = ShardMasters(client=None)  # only its slot arithmetic is used here
    ends = RecordedEnds(lambda chunk: writes.append(list(chunk)), keep_for=60, shards=shards)
    for n, family in enumerate(("a", "b", "a")):
        end = _end(n)
        ends.keep(replace(end, done_key=f"baton:{{{family}}}:done:id{n}"))
    ends.write_back("a shard's master changed", slots=[shards.slot("{a}")])
    _wait_written(writes, 2)
    time.sleep(0.05)
    assert sorted(end.done_key or "" for chunk in writes for end in chunk) == [
        "baton:{a}:done:id0",
        "baton:{a}:done:id2",
    ]


def test_a_shard_master_is_replaced_by_another_address_or_another_history() -> None:
    old = ShardMaster("10.0.0.1:7000", "r1")
    assert old.replaced_by(ShardMaster("10.0.0.2:7000", "r2"))  # a replica promoted
    assert old.replaced_by(ShardMaster("10.0.0.1:7000", "r3"))  # restarted empty
    assert not old.replaced_by(ShardMaster("10.0.0.1:7000", "r1"))
    # A master that did not say its replication id (down, INFO refused): by address.
    assert not old.replaced_by(ShardMaster("10.0.0.1:7000", UNKNOWN))
    assert ShardMaster("10.0.0.1:7000", UNKNOWN).replaced_by(ShardMaster("10.0.0.2:7000"))
