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


# -- a limit that has room again (HoldEnd.freed) -----------------------------------------


#: Rejects per loop turn in the tests of a hand-back spread over turns (HoldEnd.per_turn).
PER_TURN = 32


def held_for_cap(
    n: int,
    *,
    pool_free: list[int],
    generation: list[int] | None = None,
    per_turn: int = 0,
) -> tuple[Consumer, list[Delivery], HoldEnd, list[str]]:
    """``n`` deliveries held for a full cap's key ``cap``, a window of 3; the pool's free
    processes and the admission's generation are read from the lists (set them later)."""
    consumer = Consumer()
    consumer.initial_prefetch_count = 3  # type: ignore[attr-defined]
    held = holding(consumer, [], hold_max=1000)
    deliveries = [delivery(f"d{i}") for i in range(n)]
    for d in deliveries:
        held.hold(d, Wait(Reason.CONCURRENCY, "cap", 5.0, jitter=False))
    consumer.timer.entries.clear()  # the queue's own timer: its head is not asked here
    back: list[str] = []

    def hand_back(d: Delivery, why: str) -> None:
        assert not d.held and consumer.qos.sent == consumer.qos.count
        back.append(d.request.id)

    generation = [0] if generation is None else generation
    end = HoldEnd(
        held,
        hand_back=hand_back,
        ask=held.ask,
        generation=lambda: generation[0],
        pool_free=lambda: pool_free[0],
        per_turn=per_turn,
    )
    return consumer, deliveries, end, back


def test_a_limit_freed_while_the_pool_is_full_hands_back_past_the_window_once() -> None:
    consumer, ds, end, back = held_for_cap(10, pool_free=[0])
    ds[5].asking = True  # its answer is on its way: kept, and takes a place
    end.freed("cap", 8.0)
    end.freed("cap", 8.0)  # told again before its turn: once
    assert back == []  # on the loop's next turn, not inside the answer that told
    consumer.timer.fire()
    assert back == ["d2", "d3", "d4", "d6", "d7", "d8", "d9"]
    assert consumer.qos.count == 3 and end.handed_back == 7
    # Within its lease_ttl the key is not spread again, however full the queue.
    for d in [delivery(f"e{i}") for i in range(5)]:
        end.holding.hold(d, Wait(Reason.CONCURRENCY, "cap", 5.0, jitter=False))
    end.freed("cap", 8.0)
    consumer.timer.fire()
    assert end.handed_back == 7


def test_a_worker_whose_pool_has_room_keeps_what_it_holds() -> None:
    """A cap (or a rate) below what its pool can start: no other worker could run more
    of it, and handing back would only move the backlog to and fro."""
    pool_free = [1]
    consumer, _, end, back = held_for_cap(10, pool_free=pool_free)
    end.freed("cap", 8.0)
    consumer.timer.fire()
    assert back == []
    pool_free[0] = 0  # later, its pool full: not barred by the look that found room
    end.freed("cap", 8.0)
    consumer.timer.fire()
    assert back == [f"d{i}" for i in range(3, 10)]


def test_a_queue_within_the_window_costs_no_turn() -> None:
    consumer, _, end, back = held_for_cap(3, pool_free=[0])
    end.freed("cap", 8.0)
    assert consumer.timer.entries == [] and back == []


def test_an_exclusive_key_s_backlog_is_not_spread() -> None:
    """One run at a time anywhere: more workers holding it would run none of it sooner."""
    from celery_baton.worker.hold_end import SPREAD_FOR

    assert Reason.EXCLUSIVE not in SPREAD_FOR and Reason.ORDER not in SPREAD_FOR
    assert Reason.CONCURRENCY in SPREAD_FOR and Reason.RATE in SPREAD_FOR


def test_a_hand_back_goes_out_in_one_turn_by_default_in_order() -> None:
    consumer, _, end, back = held_for_cap(3 + 100, pool_free=[0])
    end.freed("cap", 8.0)
    consumer.timer.fire()
    assert back == [f"d{i}" for i in range(3, 103)]
    assert end.handed_back == 100 and consumer.timer.entries == []


def test_a_big_hand_back_goes_out_a_turn_at_a_time_in_order() -> None:
    HAND_BACK_TURN = PER_TURN
    consumer, _, end, back = held_for_cap(
        3 + 2 * HAND_BACK_TURN + 5, pool_free=[0], per_turn=PER_TURN
    )
    end.freed("cap", 8.0)
    consumer.timer.fire()  # the spread's turn: every one leaves the count, a turn's go
    assert back == [f"d{i}" for i in range(3, 3 + HAND_BACK_TURN)]
    assert consumer.qos.count == 3 and end.handed_back == 0  # counted once all are back
    consumer.timer.fire()
    consumer.timer.fire()
    assert back == [f"d{i}" for i in range(3, 3 + 2 * HAND_BACK_TURN + 5)]
    assert end.handed_back == 2 * HAND_BACK_TURN + 5 and consumer.timer.entries == []


def test_the_rest_of_a_hand_back_is_left_to_the_broker_when_the_connection_is_lost() -> None:
    HAND_BACK_TURN = PER_TURN
    generation = [0]
    consumer, _, end, back = held_for_cap(
        3 + 2 * HAND_BACK_TURN, pool_free=[0], generation=generation, per_turn=PER_TURN
    )
    end.freed("cap", 8.0)
    consumer.timer.fire()
    assert len(back) == HAND_BACK_TURN
    generation[0] = 1  # the broker redelivers what this worker had (a new channel)
    consumer.timer.fire()
    assert len(back) == HAND_BACK_TURN and consumer.timer.entries == []
