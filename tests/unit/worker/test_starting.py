"""Starting (worker/starting.py) without a worker: a delivery waiting for its reserved
rate slot's instant when the broker connection is lost gives its pool slot back, whether
or not Celery kept the consumer's timer (Celery 5.3 clears it in ``Consumer.on_close``;
5.6 and 5.7 keep it). The same runs under real workers in
tests/transport/test_held_broker_kill.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from celery_baton.core.policy.model import RunPlan
from celery_baton.worker.holding import Delivery, Holding
from celery_baton.worker.starting import Starting
from celery_baton.worker.verdict import Start
from tests.unit.worker.test_holding import POLICY, Consumer, Request


class Slots:
    """The pool slots: counts those reserved for deliveries and not yet run or given
    back (as SemaphoreSlots._reserved)."""

    def __init__(self) -> None:
        self.reserved = 0
        self.ran: list[Any] = []

    def give_back(self) -> None:
        self.reserved -= 1

    def run(self, request: Any) -> None:
        self.reserved -= 1
        self.ran.append(request)

    def plain(self, request: Any) -> None:
        self.ran.append(request)


class Releasing:
    def __init__(self) -> None:
        self.given_back: list[RunPlan] = []

    def give_back(self, plan: RunPlan) -> None:
        self.given_back.append(plan)

    def handed(self, request: Any) -> None:
        pass


class Events:
    def admitted(self, delivery: Delivery, *, guarded: bool) -> None:
        pass


@dataclass
class Case:
    """A delivery granted a rate slot 0.2 s ahead, on the pool slot it was asked on."""

    consumer: Consumer = field(default_factory=Consumer)
    slots: Slots = field(default_factory=Slots)
    releasing: Releasing = field(default_factory=Releasing)
    generation: int = 0

    def __post_init__(self) -> None:
        self.holding = Holding(
            self.consumer, ask=lambda d: None, hold_max=10, horizon=300, stats={"held": 0}
        )
        self.starting = Starting(
            self.consumer,
            self.slots,  # type: ignore[arg-type]
            holding=self.holding,
            releasing=self.releasing,  # type: ignore[arg-type]
            book=None,  # type: ignore[arg-type]
            stats={"admitted": 0},
            events=Events(),  # type: ignore[arg-type]
        )
        plan = RunPlan(owner="o", conditions=[], leases=[])
        self.delivery = Delivery(Request("1"), POLICY, plan, generation=0)
        self.slots.reserved += 1
        self.delivery.slot = True
        self.starting.start(self.delivery, Start(start_after=0.2), guarded=False)
        assert self.delivery.reserved_start and self.delivery.held
        assert len(self.consumer.timer.entries) == 1  # its _dispatch, at the slot's instant

    def connection_lost(self) -> None:
        """What Admission.forget_held does when the broker connection is lost."""
        self.generation += 1
        self.starting.forgotten(self.holding.forget())


def test_a_reserved_start_gives_its_pool_slot_back_when_celery_clears_the_timer() -> None:
    case = Case()
    case.connection_lost()
    case.consumer.timer.entries.clear()  # Celery 5.3's Consumer.on_close: timer.clear()
    case.consumer.timer.fire()
    assert case.slots.reserved == 0  # before: 1 for good (the pool slot never came back)
    assert case.releasing.given_back == [case.delivery.plan]
    assert not case.delivery.reserved_start and not case.delivery.slot
    assert case.slots.ran == []


def test_a_reserved_start_gives_its_pool_slot_back_once_when_the_timer_is_kept() -> None:
    case = Case()
    case.connection_lost()
    case.consumer.timer.fire()  # Celery 5.6+: its _dispatch still comes, finds it settled
    assert case.slots.reserved == 0
    assert case.releasing.given_back == [case.delivery.plan]
    assert case.slots.ran == []


def test_a_reserved_start_not_forgotten_starts_at_its_instant() -> None:
    case = Case()
    case.consumer.timer.fire()
    assert case.slots.ran == [case.delivery.request] and case.slots.reserved == 0
    assert case.releasing.given_back == []
    assert not case.delivery.held
