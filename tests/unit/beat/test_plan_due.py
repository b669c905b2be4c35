"""beat/slots.py ``plan_due``: which due slots of an entry fire, which are missed."""

from __future__ import annotations

import pytest

from celery_baton.beat.slots import IntervalRule, Policy, plan_due

T0 = 1_780_000_000_000
EVERY_1S = IntervalRule(1000)


def test_one_due_slot_fires() -> None:
    single = plan_due(EVERY_1S, T0, T0 + 900, Policy())
    assert single.fire == [T0] and not single.missed and not single.coalesced
    assert single.next_slot == T0 + 1000


@pytest.mark.parametrize("misfire", ["skip", "latest"])
def test_late_slots_within_the_grace_coalesce_into_the_newest(misfire: str) -> None:
    """A failover's 6 due slots: one run (the newest), 5 missed, coalesced."""
    plan = plan_due(EVERY_1S, T0, T0 + 5200, Policy(misfire=misfire))
    assert plan.fire == [T0 + 5000]
    assert plan.missed == [T0 + k * 1000 for k in range(5)]
    assert plan.coalesced and plan.next_slot == T0 + 6000


def test_all_keeps_the_catch_up() -> None:
    plan = plan_due(EVERY_1S, T0, T0 + 5200, Policy(misfire="all"))
    assert plan.fire == [T0 + k * 1000 for k in range(6)]
    assert not plan.missed and not plan.coalesced
    capped = plan_due(EVERY_1S, T0, T0 + 5200, Policy(misfire="all", max_runs=2))
    assert capped.fire == [T0 + 4000, T0 + 5000] and len(capped.missed) == 4
    assert not capped.coalesced  # dropped by the cap, not run for


def test_past_the_grace_skip_fires_none_and_latest_the_newest() -> None:
    now = T0 + 60_000
    skip = plan_due(EVERY_1S, T0, T0 + 40_000, Policy(grace=10))
    assert skip.fire == [T0 + 40_000] and skip.coalesced  # on-time ones exist
    old = plan_due(IntervalRule(60_000), T0, now + 15_000, Policy(grace=10))
    assert old.fire == [] and old.missed == [T0, T0 + 60_000] and not old.coalesced
    latest = plan_due(IntervalRule(60_000), T0, now + 15_000, Policy(misfire="latest", grace=10))
    assert latest.fire == [T0 + 60_000] and latest.missed == [T0] and latest.coalesced


def test_a_typo_in_the_policy_is_refused() -> None:
    with pytest.raises(ValueError, match=r"baton_misfire must be one of .*got 'coalesce'"):
        Policy(misfire="coalesce")
