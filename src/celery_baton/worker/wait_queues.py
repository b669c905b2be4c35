"""The wait queues of held deliveries: one FIFO per key, ordered by message priority.

A delivery waits in the queue of the key that refused it. With ``fair_key``, a shared
limit's queue is one per fair key value (``<limit key>#<value digest>``): each asks for
its own head, and the fair queues of a limit are grouped under the limit's key, so that
a release of the limit wakes them all (``woken_by``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar


class Waiting(Protocol):
    """What a queue reads of a held delivery (holding.py's ``Delivery``, which builds
    the queues: named here by its shape, so that this module needs nothing of it)."""

    request: Any
    asking: bool


Delivery = TypeVar("Delivery", bound=Waiting)


class WaitQueues(Generic[Delivery]):
    """Queue key -> its held deliveries; limit key -> its fair queues.

    ``rank(request)`` is a request's urgency (higher first; None: no priority);
    ``strict(request)``: its rank must hold even against a head that is asking (an
    ordered call's position: only a queue's head asks, and a later position at the head
    would keep the call whose turn it is from asking).
    """

    def __init__(
        self,
        rank: Callable[[Any], float | None],
        strict: Callable[[Any], bool] = lambda request: False,
    ) -> None:
        self.rank = rank
        self.strict = strict
        self._queues: dict[str, deque[Delivery]] = {}
        self._fair_groups: dict[str, set[str]] = {}  # limit key -> its fair queues

    def add(self, queue_key: str, limit_key: str, delivery: Delivery) -> None:
        """Queue ``delivery`` in ``queue_key``'s queue, a fair queue of ``limit_key``
        when the two differ."""
        self._enqueue(self._queues.setdefault(queue_key, deque()), delivery)
        if queue_key != limit_key:
            self._fair_groups.setdefault(limit_key, set()).add(queue_key)

    def get(self, queue_key: str) -> deque[Delivery] | None:
        return self._queues.get(queue_key)

    def others_waiting(self, queue_key: str, delivery: Delivery) -> bool:
        """Whether ``queue_key``'s queue holds a delivery other than ``delivery`` that
        is not asking the store right now.

        What a fair ask tells the store (``FairTurn.more``: keep this worker's key in
        the turn after this grant). A delivery asking now does not count: its own ask
        reaches the store first (one connection, in order) and says for itself whether
        it still waits (a refusal keeps the key in the turn). Counted, two asks in
        flight together each said the other still waited, and the later grant kept a
        key with nothing left waiting in the turn, ahead of the others, for
        ``fairness.PRESENCE``."""
        queue = self._queues.get(queue_key)
        if not queue:
            return False
        return any(other is not delivery and not other.asking for other in queue)

    def _enqueue(self, queue: deque[Delivery], delivery: Delivery) -> None:
        """FIFO within a priority; a delivery of a higher message priority goes before
        those of a lower one (not before a head that is asking right now), so under a
        saturated limit the urgent work is admitted first, whatever the broker's own
        support for priorities."""
        rank = self.rank(delivery.request)
        if rank is None or not queue:
            queue.append(delivery)
            return
        first = 1 if queue[0].asking and not self.strict(delivery.request) else 0
        for index in range(first, len(queue)):
            other = self.rank(queue[index].request)
            if other is None or rank > other:
                queue.insert(index, delivery)
                return
        queue.append(delivery)

    def drop(self, queue_key: str) -> None:
        """Forget ``queue_key``'s queue (it is empty)."""
        self._queues.pop(queue_key, None)
        limit_key = queue_key.rpartition("#")[0]
        group = self._fair_groups.get(limit_key)
        if group is not None:
            group.discard(queue_key)
            if not group:
                del self._fair_groups[limit_key]

    def waiting_for(self, key: str) -> bool:
        """Whether a queue here waits for a release of ``key``."""
        return key in self._queues or key in self._fair_groups

    def woken_by(self, key: str) -> list[str]:
        """The queues a release of ``key`` wakes: its own and each fair queue of it."""
        return [key, *self._fair_groups.get(key, ())]

    def sizes(self) -> list[tuple[int, str]]:
        return [(len(queue), key) for key, queue in self._queues.items()]

    def clear(self) -> None:
        self._queues.clear()
        self._fair_groups.clear()
