"""A beat slot that ran is recorded in one key per entry, whatever the entry's frequency
(issue 28, item 12): the gate and release scripts against a real server.

Before, each slot left a done marker for a day: 86,400 keys a day for a 1 s entry. Each
slot is driven here as a worker admits it (``run_once`` policy, gate script) and ends it
(release script), with the link the beat's message carries (policy/slot_runs.py).
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator, Sequence

import pytest
import redis

from celery_baton.core.conditions import SlotNotRun
from celery_baton.core.gate import Gate, Release
from celery_baton.core.keys import KeyNames
from celery_baton.core.leases import new_owner
from celery_baton.core.policy.model import TaskPolicy
from celery_baton.core.policy.per_call import BEAT_SLOT_RETENTION
from celery_baton.core.policy.plan import plan_delivery
from celery_baton.core.policy.slot_runs import SlotRun, slot_run
from celery_baton.store.connection import connect

TASK = "proj.tick"
NAMES = KeyNames()
POLICY = TaskPolicy(
    name=TASK, lease_ttl=30.0, redelivery_guard=True, redelivery_retention=BEAT_SLOT_RETENTION
)
DAY = 86_400
RECORD = NAMES.slot_runs(TASK, "proj", "tick")


@pytest.fixture
def gate(store_url: str) -> Iterator[Gate]:
    store = connect(store_url, socket_timeout=5)
    yield Gate(store)
    store.client.close()


def run_slots(gate: Gate, runs: Sequence[SlotRun], *, copies: bool = False) -> list[bool]:
    """Admit and end each slot as a worker does, in batches (one round trip each way);
    returns which were granted. ``copies``: only ask, then give the leases back
    unrecorded (whether a copy would be admitted)."""
    granted: list[bool] = []
    for start in range(0, len(runs), 2000):
        batch = runs[start : start + 2000]
        plans = []
        for run in batch:
            task_id = f"{run.entry}-{run.slot}"
            plans.append(
                plan_delivery(
                    POLICY,
                    NAMES,
                    task_id=task_id,
                    owner=new_owner(task_id, "w@h"),
                    args=(),
                    kwargs={},
                    slot_run=run,
                )
            )
        calls = [gate.call(p.conditions, p.owner, 30.0, 0.0) for p in plans]
        replies = gate.store.scripts.call_many("gate", calls)
        decisions = [gate.decision(p.conditions, r) for p, r in zip(plans, replies, strict=True)]
        granted += [d.granted for d in decisions]
        releases = [
            Release(
                tuple(lease.key for lease in p.leases),
                p.owner,
                None if copies else p.done_key,
                POLICY.redelivery_retention,
                done_link=p.done_link,
            )
            for p in plans
        ]
        gate.release_many(releases)
    return granted


def series(first: int, count: int, every_ms: int = 1000, entry: str = "tick") -> list[SlotRun]:
    slots = [first + i * every_ms for i in range(count)]
    return [
        SlotRun("proj", entry, slot, slots[i - 1] if i else None) for i, slot in enumerate(slots)
    ]


def family_keys(r: redis.Redis) -> list[str]:
    """The task family's keys, but the one that lives a second (gate.lua, "E": a
    verified epoch kept for a second), there or not by chance."""
    keys = r.scan_iter(match=f"baton:{{{TASK}}}:*", count=10_000)
    return sorted(key for key in keys if not key.endswith(":epoch:here"))


def memory(r: redis.Redis, keys: Sequence[str]) -> int:
    return sum(int(r.memory_usage(key, samples=0) or 0) for key in keys)


def now_ms() -> int:
    return int(time.time() * 1000)


@pytest.mark.timeout(180)
def test_a_day_of_one_second_slots_keeps_one_key(gate: Gate, r: redis.Redis) -> None:
    """86,400 one-second slots, each run once in order: the store keeps one run record
    (one member) for the entry, of the same size after an hour as after the day; the
    old code kept a key per slot (86,400 keys, ~10 MB)."""
    day = series(now_ms() - DAY * 1000, DAY)
    hour = 3600
    assert all(run_slots(gate, day[:hour]))
    after_an_hour = family_keys(r)
    bytes_after_an_hour = memory(r, after_an_hour)
    assert all(run_slots(gate, day[hour:]))
    after_a_day = family_keys(r)
    bytes_after_a_day = memory(r, after_a_day)

    assert RECORD in after_a_day
    assert len(after_a_day) <= 2, after_a_day[:10]  # the record and the family's epoch
    assert after_a_day == after_an_hour
    assert bytes_after_a_day == bytes_after_an_hour
    assert r.zcard(RECORD) == 1
    assert memory(r, [RECORD]) < 300
    assert 0 < r.pttl(RECORD) <= BEAT_SLOT_RETENTION * 1000
    # Every slot of the day is still known to have run: a copy is refused, wherever it
    # falls; the entry's next slot runs.
    picks = [day[0], day[1], day[DAY // 2], day[-1]]
    assert run_slots(gate, picks, copies=True) == [False] * len(picks)
    following = SlotRun("proj", "tick", day[-1].slot + 1000, day[-1].slot)
    assert run_slots(gate, [following]) == [True]


def test_slots_out_of_order_join_into_one_run(gate: Gate, r: redis.Redis) -> None:
    """Slots that end out of order (several workers) leave a gap per slot still to run;
    a slot not run yet is never refused, one that ran always is, and once the gaps are
    filled the record is one member again."""
    runs = series(now_ms() - 60_000, 10)
    order = [0, 1, 4, 6, 3, 9]
    assert run_slots(gate, [runs[i] for i in order]) == [True] * len(order)
    assert r.zcard(RECORD) == 4  # runs 0-1, 3-4, 6, 9
    assert run_slots(gate, [runs[i] for i in order], copies=True) == [False] * len(order)
    assert run_slots(gate, [runs[i] for i in (2, 5, 7, 8)], copies=True) == [True] * 4
    assert run_slots(gate, [runs[i] for i in (8, 2, 5, 7)]) == [True] * 4
    assert r.zcard(RECORD) == 1
    assert run_slots(gate, runs, copies=True) == [False] * 10


def test_recorded_twice_is_recorded_once(gate: Gate, r: redis.Redis) -> None:
    """The pool process and the main process both record a run's end: the same slot
    recorded again changes nothing."""
    runs = series(now_ms() - 10_000, 3)
    run_slots(gate, runs)
    before = r.zrange(RECORD, 0, -1, withscores=True)
    release = Release((), "x|w|1", RECORD, BEAT_SLOT_RETENTION, done_link=runs[1].link)
    gate.release_many([release, release])
    assert r.zrange(RECORD, 0, -1, withscores=True) == before


def test_gaps_are_bounded(gate: Gate, r: redis.Redis) -> None:
    """Every other slot lost (never delivered): at most 100 gaps are kept, the oldest
    closed first (its slot then taken as run); the newest gaps still admit their slot."""
    runs = series(now_ms() - 3_600_000, 600)
    assert all(run_slots(gate, runs[::2]))
    assert r.zcard(RECORD) == 101
    assert run_slots(gate, [runs[1]], copies=True) == [False]  # closed: taken as run
    assert run_slots(gate, [runs[-3]], copies=True) == [True]  # a gap still kept


def test_gaps_older_than_the_retention_are_closed(gate: Gate, r: redis.Redis) -> None:
    """A slot that has not run a day after its time is no longer waited for: its gap is
    closed (the record stays one member); a recent gap is kept."""
    old = series(now_ms() - 2 * DAY * 1000, 3)
    run_slots(gate, [old[0], old[2]])
    assert r.zcard(RECORD) == 1
    recent = series(now_ms() - 10_000, 3, entry="other")
    run_slots(gate, [recent[0], recent[2]])
    assert r.zcard(NAMES.slot_runs(TASK, "proj", "other")) == 2


def test_entries_and_apps_have_their_own_record(gate: Gate, r: redis.Redis) -> None:
    """Two entries of one name in two apps (one slot time each) do not see each other's
    runs."""
    slot = now_ms() - 5_000
    mine = SlotRun("proj", "tick", slot, None)
    theirs = SlotRun("other-app", "tick", slot, None)
    assert run_slots(gate, [mine]) == [True]
    assert run_slots(gate, [theirs], copies=True) == [True]


def test_headers_of_a_trigger_or_an_older_beat_name_no_series() -> None:
    """Only a scheduled slot's message names its series; a trigger or an older beat's
    message is judged by its task id, as before."""
    base = {"baton_beat_slot": 2000, "baton_beat_entry": "tick"}
    assert slot_run(base) is None
    assert slot_run({**base, "baton_beat_series": {"app": "a", "before": 1000}}) == SlotRun(
        "a", "tick", 2000, 1000
    )
    assert slot_run({**base, "baton_beat_series": {"app": "a", "before": None}}) == SlotRun(
        "a", "tick", 2000, None
    )
    for bad in ({"app": "a", "before": 3000}, {"before": 1000}, "x", {"app": "a", "before": "?"}):
        assert slot_run({**base, "baton_beat_series": bad}) is None


def test_any_order_with_repeats_records_exactly_the_slots_that_ran(gate: Gate) -> None:
    """Random series recorded in random order, some slots twice: after each record a
    slot is refused exactly when it was recorded, and the whole series ends as one run."""
    rng = random.Random(28)
    for trial in range(60):
        entry = f"e{trial}"
        first = now_ms() - 100_000
        slots = sorted(rng.sample(range(first, first + 90_000), rng.randint(1, 40)))
        runs = [SlotRun("proj", entry, s, slots[i - 1] if i else None) for i, s in enumerate(slots)]
        order = list(range(len(runs))) + [rng.randrange(len(runs)) for _ in range(len(runs) // 3)]
        rng.shuffle(order)
        record = NAMES.slot_runs(TASK, "proj", entry)
        recorded: set[int] = set()
        for n, i in enumerate(order):
            release = Release((), "x|w|1", record, BEAT_SLOT_RETENTION, done_link=runs[i].link)
            gate.release_many([release])
            recorded.add(i)
            if n % 4 == 0 or n == len(order) - 1:
                conditions = [[SlotNotRun(record, r.slot, "id")] for r in runs]
                calls = [gate.call(c, "o|w|1", 30.0, 0.0) for c in conditions]
                refused = [int(r[0]) == 0 for r in gate.store.scripts.call_many("gate", calls)]
                assert refused == [j in recorded for j in range(len(runs))], (trial, order)
        assert gate.store.client.zcard(record) == 1
