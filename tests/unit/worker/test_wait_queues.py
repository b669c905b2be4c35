"""worker/wait_queues.py: what a fair ask says of the requests still waiting here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from celery_baton.worker.wait_queues import WaitQueues


@dataclass(eq=False)
class Held:
    request: Any = field(default_factory=object)
    asking: bool = False


def queues_of(*held: Held) -> WaitQueues[Held]:
    queues: WaitQueues[Held] = WaitQueues(rank=lambda request: None)
    for h in held:
        queues.add("cc#b", "cc", h)
    return queues


def test_a_request_alone_in_its_queue_has_no_others() -> None:
    b1 = Held()
    assert not queues_of(b1).others_waiting("cc#b", b1)
    assert not queues_of().others_waiting("cc#b", b1)


def test_another_request_waiting_counts() -> None:
    b1, b2 = Held(), Held()
    queues = queues_of(b1, b2)
    assert queues.others_waiting("cc#b", b1)
    assert queues.others_waiting("cc#b", b2)
    assert queues.others_waiting("cc#b", Held())  # a new one, not queued yet


def test_a_request_asking_now_does_not_count() -> None:
    """Its own ask, ahead on the connection, tells the store whether it still waits: a
    new request asking beside it must not also keep the key in the turn for it."""
    b1 = Held(asking=True)
    queues = queues_of(b1)
    assert not queues.others_waiting("cc#b", Held(asking=True))
    b2 = Held()
    queues.add("cc#b", "cc", b2)
    assert queues.others_waiting("cc#b", Held(asking=True))
