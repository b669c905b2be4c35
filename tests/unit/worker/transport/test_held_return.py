"""Which held messages a worker puts back after its broker crashed
(worker/transport/held_return.py), without a broker: the channels are stand-ins that
record what is asked of them. The same code runs against a SIGKILLed broker in
tests/exclusive/test_faults.py::test_a_worker_holding_a_request_lives_through_a_broker_crash.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from celery_baton.core.policy.model import RunPlan, TaskPolicy
from celery_baton.worker.holding import Delivery
from celery_baton.worker.transport.held_return import HeldReturn, returnable


def test_only_tags_the_old_channel_could_not_restore_and_received_recently() -> None:
    held = [("a", 100.0), ("b", 100.0), ("old", 10.0), (None, 100.0), ("", 100.0)]
    # "b" was restored by the old channel's close (it may be another worker's now);
    # "old" was received more than half the visibility timeout ago.
    assert returnable(held, {"a", "old", ""}, now=110.0, visibility=60.0) == ["a"]
    assert returnable(held, {"a", "old"}, now=110.0, visibility=3600.0) == ["a", "old"]


@dataclass
class QoS:
    delivered: dict[str, Any] = field(default_factory=dict)
    restored: list[str] = field(default_factory=list)
    fail_after: int | None = None

    @property
    def _delivered(self) -> dict[str, Any]:
        return self.delivered

    def restore_by_tag(self, tag: str) -> None:
        if self.fail_after is not None and len(self.restored) >= self.fail_after:
            raise ConnectionError("broker gone again")
        self.restored.append(tag)


def delivery(tag: str | None, since: float) -> Delivery:
    request = SimpleNamespace(id=tag, message=SimpleNamespace(delivery_tag=tag))
    plan = RunPlan(owner="o", conditions=[], leases=[])
    return Delivery(request, TaskPolicy(name="t", lease_ttl=30), plan, generation=0, since=since)


def test_put_back_through_the_new_channel_and_never_again_by_the_old_one() -> None:
    now = time.monotonic()
    old = SimpleNamespace(qos=QoS({"a": 1, "c": 3, "running": 4}))
    new = SimpleNamespace(qos=QoS())
    back = HeldReturn(visibility=3600.0)
    back.remember([delivery("a", now), delivery("b", now), delivery("c", now - 3000)], old)
    assert back.put_back(new) == 1
    assert new.qos.restored == ["a"]
    # kombu restores what is left in the old channel when it is collected: not "a".
    assert old.qos.delivered == {"c": 3, "running": 4}
    assert back.put_back(new) == 0  # once


def test_a_broker_that_fails_again_leaves_the_rest_to_its_visibility_timeout() -> None:
    now = time.monotonic()
    old = SimpleNamespace(qos=QoS({"a": 1, "b": 2}))
    new = SimpleNamespace(qos=QoS(fail_after=1))
    back = HeldReturn(visibility=3600.0)
    back.remember([delivery("a", now), delivery("b", now)], old)
    assert back.put_back(new) == 1
    assert old.qos.delivered == {"b": 2}


def test_nothing_held_or_no_channel_puts_nothing_back() -> None:
    back = HeldReturn(visibility=3600.0)
    back.remember([], SimpleNamespace(qos=QoS({"a": 1})))
    assert back.put_back(SimpleNamespace(qos=QoS())) == 0
    back.remember([delivery("a", time.monotonic())], None)
    assert back.put_back(SimpleNamespace(qos=QoS())) == 0


def test_batched_calls_are_put_back_as_held_deliveries_are() -> None:
    now = time.monotonic()
    old = SimpleNamespace(qos=QoS({"a": 1, "x": 2, "y": 3}))
    new = SimpleNamespace(qos=QoS())
    back = HeldReturn(visibility=3600.0)
    batched = [(delivery(tag, 0).request, since) for tag, since in (("x", now), ("y", -1e9))]
    back.remember([delivery("a", now)], old, batched)
    assert back.put_back(new) == 2
    assert new.qos.restored == ["a", "x"]  # "y": received too long ago, the broker's
