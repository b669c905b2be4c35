"""The end of a store-wide hold (worker/hold_end.py) without a worker: which held
deliveries go back to the broker, and that they go on the loop's next turn, once. The
same code runs under real workers in tests/worker/test_hold_spread.py."""

from __future__ import annotations

from celery_baton.worker.hold_end import HoldEnd, judged_here, split
from celery_baton.worker.holding import Delivery
from celery_baton.worker.verdict import Reason, Wait
from tests.unit.worker.test_holding import Consumer, delivery, holding


def grace(key: str = "grace") -> Wait:
    return Wait(Reason.GRACE, key, 5.0, jitter=False)


def held_for_grace(
    n: int, asked: list[str] | None = None
) -> tuple[Consumer, list[Delivery], HoldEnd, list[str]]:
    consumer = Consumer()
    consumer.initial_prefetch_count = 3  # type: ignore[attr-defined]
    asked = [] if asked is None else asked
    held = holding(consumer, asked, hold_max=100)
    deliveries = [delivery(f"d{i}") for i in range(n)]
    for d in deliveries:
        held.hold(d, grace())
    back: list[str] = []

    def hand_back(d: Delivery, why: str) -> None:
        # Their prefetch slots are given back (and sent) before any goes to the broker.
        assert not d.held and consumer.qos.sent == consumer.qos.count
        held.release(d)
        back.append(d.request.id)

    end = HoldEnd(held, hand_back=hand_back, ask=held.ask, generation=lambda: 0)
    return consumer, deliveries, end, back


def test_past_the_window_in_arrival_order_the_busy_ones_kept_and_counted() -> None:
    _, ds, _, _ = held_for_grace(6)
    ds[4].asking = True  # its answer is on the way: kept, and takes a place
    kept, back = split(ds, Reason.GRACE, 3)
    assert [d.request.id for d in kept] == ["d0", "d1"]
    assert [d.request.id for d in back] == ["d2", "d3", "d5"]
    assert split(ds, Reason.STORE_DOWN, 3) == ([], [])  # held for another reason


def test_a_higher_priority_is_kept_before_an_earlier_arrival() -> None:
    ds = [delivery("low", 1), delivery("urgent", 9)]
    for d in ds:
        d.held, d.held_for = True, Reason.GRACE
    kept, back = split(ds, Reason.GRACE, 1, rank=lambda r: r.delivery_info.get("priority"))
    assert [d.request.id for d in kept] == ["urgent"]
    assert [d.request.id for d in back] == ["low"]


def test_a_held_beat_slot_is_kept_past_the_window_for_its_misfire_policy() -> None:
    ds = [delivery(f"d{i}") for i in range(3)]
    slot = delivery("slot")
    slot.request.request_dict = {"baton_beat_slot": 1, "baton_beat_misfire": {"grace": 2}}  # type: ignore[attr-defined]
    for d in (*ds, slot):
        d.held, d.held_for = True, Reason.GRACE
    kept, back = split([*ds, slot], Reason.GRACE, 1)
    assert [d.request.id for d in kept] == ["d0"]  # the window: asked at once
    assert [d.request.id for d in back] == ["d1", "d2"]
    assert [d.request.id for d in judged_here([*ds, slot], Reason.GRACE)] == ["slot"]


def test_a_fair_key_s_and_a_flow_s_requests_are_kept_past_the_window() -> None:
    """Their turns are judged among the requests held (tenants alternate; a key's calls
    in publish order): handed back, a small tenant's went behind a big one's backlog."""
    import dataclasses

    ds = [delivery(f"d{i}") for i in range(3)]
    fair, flow = delivery("fair"), delivery("flow")
    fair.plan = dataclasses.replace(fair.plan, fair_limits={"limit": "limit:tenant-b"})
    flow.plan = dataclasses.replace(flow.plan, flow_key="flow:key")
    for d in (*ds, fair, flow):
        d.held, d.held_for = True, Reason.GRACE
    kept, back = split([*ds, fair, flow], Reason.GRACE, 1)
    assert [d.request.id for d in kept] == ["d0"]
    assert [d.request.id for d in back] == ["d1", "d2"]
    held = [*ds, fair, flow]
    assert [d.request.id for d in judged_here(held, Reason.GRACE)] == ["fair", "flow"]


def test_handed_back_on_the_next_turn_once_after_the_lower_prefetch_count_is_sent() -> None:
    asked: list[str] = []
    consumer, _, end, back = held_for_grace(10, asked)
    assert consumer.qos.count == 10
    end.ended(Reason.GRACE, "the store's grace ended")
    end.ended(Reason.GRACE, "the store's grace ended")  # told twice: handed back once
    assert back == []  # not from inside the answer that told
    consumer.timer.fire()  # also the grace queue's timer: d0, its head, asks (kept)
    assert back == [f"d{i}" for i in range(3, 10)]
    assert consumer.qos.count == 3 and end.handed_back == 7
    # The kept ones behind the head ask now, in their order, not one after another.
    assert asked == ["d0", "d1", "d2"]


def test_a_worker_without_a_prefetch_limit_keeps_all() -> None:
    consumer, _, end, back = held_for_grace(10)
    consumer.initial_prefetch_count = 0  # type: ignore[attr-defined]
    end.ended(Reason.GRACE, "the store's grace ended")
    consumer.timer.fire()
    assert back == []


def test_a_fair_backlog_stays_in_its_tenants_queues_and_only_their_heads_ask() -> None:
    """Tenant A's 5 then B's 1, held for the grace. At its end none goes back and each
    tenant's head asks, B's among them: the store learns that a tenant waits only from
    its asks. Asked all at once (as the window is), B's joined the line for a pool
    process behind every A (tests/limits/test_fairness.py's grace case: 96 A runs after
    B's requests were all in the workers, the bound 60)."""
    import dataclasses

    consumer = Consumer()
    consumer.initial_prefetch_count = 1  # type: ignore[attr-defined]
    asked: list[str] = []
    held = holding(consumer, asked, hold_max=100)

    def of(tenant: str, n: int) -> Delivery:
        d = delivery(f"{tenant}{n}")
        d.plan = dataclasses.replace(
            d.plan, fair_limits={"fair": "cap"}, fair_queues={"cap": f"cap#{tenant}"}
        )
        return d

    for d in [of("A", n) for n in range(5)] + [of("B", 0)]:
        held.hold(d, grace())
    end = HoldEnd(held, hand_back=lambda d, why: None, ask=held.ask, generation=lambda: 0)
    end.ended(Reason.GRACE, "the store's grace ended")
    consumer.timer.fire()  # the hand-back's turn; it wakes each tenant's queue
    consumer.timer.fire()
    assert end.handed_back == 0
    assert sorted(asked) == ["A0", "B0"]
