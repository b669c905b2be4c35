"""Holding (worker/holding.py) without a worker: one queue per key, only its head asks,
priorities, the prefetch count up to ``baton_hold_max``, timers. The consumer is a
stand-in that records what holding asks of it (its timer, its prefetch count); the
same code runs under real workers in tests/limits/test_hold.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from celery_baton.core.policy.model import RunPlan, TaskPolicy
from celery_baton.worker.holding import Delivery, Holding
from celery_baton.worker.verdict import Reason, Wait


@dataclass
class Entry:
    delay: float
    fn: Callable[..., None]
    args: tuple[Any, ...]
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True


@dataclass
class Timer:
    entries: list[Entry] = field(default_factory=list)

    def call_after(
        self, delay: float, fn: Callable[..., None], args: tuple[Any, ...], priority: int = 0
    ) -> Entry:
        entry = Entry(delay, fn, args)
        self.entries.append(entry)
        return entry

    def fire(self) -> None:
        """Run every entry due, as the consumer's loop would (new ones wait their turn)."""
        due, self.entries = self.entries, []
        for entry in due:
            if not entry.cancelled:
                entry.fn(*entry.args)


@dataclass
class Prefetch:
    count: int = 0
    sent: int | None = None  # the count last sent to the broker (update)

    def increment_eventually(self) -> None:
        self.count += 1

    def decrement_eventually(self) -> None:
        self.count -= 1

    def update(self) -> None:
        """Sends the count to the broker now (Celery's loop does it at its next turn)."""
        self.sent = self.count


@dataclass
class Consumer:
    timer: Timer = field(default_factory=Timer)
    qos: Prefetch = field(default_factory=Prefetch)


@dataclass
class Request:
    id: str
    priority: int | None = None
    name: str = "t.feed"
    task: object = None

    @property
    def delivery_info(self) -> dict[str, Any]:
        return {} if self.priority is None else {"priority": self.priority}


POLICY = TaskPolicy(name="t.feed", lease_ttl=30)
PLAN = RunPlan(owner="o", conditions=[], leases=[])


def delivery(task_id: str, priority: int | None = None) -> Delivery:
    return Delivery(Request(task_id, priority), POLICY, PLAN, generation=0)


def holding(consumer: Consumer, asked: list[str], hold_max: int = 10) -> Holding:
    def ask(d: Delivery) -> None:
        asked.append(d.request.id)
        d.asking = True

    def rank(request: Any) -> float | None:
        return request.delivery_info.get("priority")

    return Holding(consumer, ask=ask, hold_max=hold_max, horizon=300, stats={"held": 0}, rank=rank)


def wait(key: str = "k", delay: float = 1.0) -> Wait:
    return Wait(Reason.EXCLUSIVE, key, delay, jitter=False)


def test_held_deliveries_raise_the_prefetch_count_up_to_hold_max() -> None:
    consumer = Consumer()
    held = holding(consumer, [], hold_max=2)
    a, b, c = delivery("a"), delivery("b"), delivery("c")
    for d in (a, b, c):
        held.hold(d, wait())
    assert held.held_count == 3 and consumer.qos.count == 2  # c keeps its prefetch slot
    assert held.held_by_key() == {"k": 3}
    held.release(c)  # not counted: the count stays
    assert consumer.qos.count == 2
    held.release(a)
    assert held.held_count == 1 and consumer.qos.count == 1


def test_only_the_head_of_a_queue_asks_and_the_next_asks_when_it_leaves() -> None:
    consumer, asked = Consumer(), []
    held = holding(consumer, asked)
    a, b = delivery("a"), delivery("b")
    held.hold(a, wait())
    held.hold(b, wait())
    assert len(consumer.timer.entries) == 1  # one timer per key, not per delivery
    consumer.timer.fire()
    assert asked == ["a"]
    a.asking = False
    held.release(a)  # it starts: the next may pass now, asked on the loop's next turn
    consumer.timer.fire()
    assert asked == ["a", "b"]


def test_a_higher_priority_goes_first_but_never_before_a_head_that_is_asking() -> None:
    consumer, asked = Consumer(), []
    held = holding(consumer, asked)
    first, low, urgent = delivery("first", 1), delivery("low", 1), delivery("urgent", 9)
    held.hold(first, wait())
    consumer.timer.fire()  # "first" is asking now
    held.hold(low, wait())
    held.hold(urgent, wait())
    first.asking = False
    held.release(first)
    consumer.timer.fire()
    assert asked == ["first", "urgent"]


def test_an_earlier_wake_up_replaces_a_later_one_never_the_reverse() -> None:
    consumer = Consumer()
    held = holding(consumer, [])
    held.arm("k", 5.0, jitter=False)
    held.arm("k", 10.0, jitter=False)
    assert [e.delay for e in consumer.timer.entries] == [5.0]
    held.arm("k", 1.0, jitter=False)
    assert [(e.delay, e.cancelled) for e in consumer.timer.entries] == [(5.0, True), (1.0, False)]


def test_a_lost_connection_forgets_every_held_delivery_and_its_timers() -> None:
    consumer = Consumer()
    held = holding(consumer, [])
    for task_id, key in (("a", "k1"), ("b", "k2"), ("c", "k2")):
        held.hold(delivery(task_id), wait(key))
    assert sorted(d.request.id for d in held.forget()) == ["a", "b", "c"]
    assert held.held_count == 0 and held.held_by_key() == {}
    assert all(e.cancelled for e in consumer.timer.entries)


def test_only_a_plan_that_limits_other_work_waits_for_a_pool_slot() -> None:
    from celery_baton.core.conditions import (
        Condition,
        FreeUnique,
        NotDone,
        NotSuperseded,
        Rate,
        SlotNotRun,
        TakeLease,
    )

    run_key, done_key = "baton:{t}:run:1", "baton:{t}:done:1"
    guard: list[Condition] = [TakeLease(run_key), NotDone(done_key, "s1", "1")]

    def at_start(conditions: list[Condition]) -> bool:
        plan = RunPlan(owner="o", conditions=conditions, leases=[], run_key=run_key)
        return Delivery(Request("1"), POLICY, plan, generation=0).at_start

    assert not at_start(guard)  # the guard keeps out only copies of itself
    # A beat slot: the guard and its entry's run record (policy/slot_runs.py)
    assert not at_start([*guard, SlotNotRun("baton:{t}:beat-runs:e", 1000, "1")])
    assert at_start([*guard, TakeLease("baton:{t}:ex:k")])  # exclusive
    assert at_start([*guard, Rate("baton:{t}:rate", 500_000)])
    assert at_start([TakeLease("baton:{t}:cc", limit=2)])  # concurrency
    assert at_start([*guard, FreeUnique("baton:{t}:u:k", "1")])  # unique until started
    assert at_start([*guard, NotSuperseded("baton:{t}:n:1", 30)])


def test_a_throttle_waits_for_a_pool_slot_and_a_debounce_does_not() -> None:
    """A throttle is one start per window: its window opens at the start. A debounce
    limits nothing (the newest call runs once the key is quiet): asked on arrival."""
    import dataclasses

    from celery_baton.core.debounce import FlowKind, FlowPolicy

    plan = RunPlan(owner="o", conditions=[], leases=[], flow_key="baton:{t}:flow:k")

    def at_start(kind: FlowKind) -> bool:
        policy = dataclasses.replace(POLICY, flow=FlowPolicy(kind, 2.0, None))
        return Delivery(Request("1"), policy, plan, generation=0).at_start

    assert at_start(FlowKind.THROTTLE)
    assert not at_start(FlowKind.DEBOUNCE)


def test_an_ordered_call_goes_before_a_later_position_even_one_that_is_asking() -> None:
    """Only a queue's head asks: a later position of an ordered key at the head, asking
    and denied again and again, would keep the call whose turn it is from asking."""
    consumer, asked = Consumer(), []

    def ask(d: Delivery) -> None:
        asked.append(d.request.id)
        d.asking = True

    held = Holding(
        consumer,
        ask=ask,
        hold_max=10,
        horizon=300,
        stats={"held": 0},
        rank=lambda request: -float(request.priority),  # the position, as ordering.rank
        strict_rank=lambda request: True,
    )
    later, turn = delivery("position 24", 24), delivery("position 19", 19)
    held.hold(later, wait())
    consumer.timer.fire()  # "position 24" is asking now
    held.hold(turn, wait())
    later.asking = False
    held.hold(later, wait())  # denied again: it stays behind
    consumer.timer.fire()
    assert asked == ["position 24", "position 19"]


def test_a_held_key_is_logged_with_its_words_when_the_plan_labelled_it() -> None:
    from types import SimpleNamespace

    from celery_baton.worker.holding import _key_said

    key = "baton:{proj.tasks.fetch}:rate:b8e1d"
    labelled: Any = SimpleNamespace(plan=SimpleNamespace(labels={key: '{"account": 42}'}))
    assert _key_said(labelled, key) == f"{key} (fetch(account=42))"
    unlabelled: Any = SimpleNamespace(plan=SimpleNamespace(labels={}))
    assert _key_said(unlabelled, key) == key
    assert _key_said(unlabelled, "") == "the store's grace"
