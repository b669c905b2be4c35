"""When the task consumer is opened again (worker/transport/consumer_window.py): the
rule alone, and the window driven by a stand-in consumer that records what is asked of
it. The real broker and worker: tests/transport/test_held_window.py."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
from kombu import Queue

from celery_baton.worker.transport import consumer_window
from celery_baton.worker.transport.consumer_window import (
    ConsumerWindow,
    headroom,
    new_prefetch,
    single_active_queues,
)


def test_the_headroom_is_half_the_window_and_at_least_one() -> None:
    assert [headroom(w) for w in (1, 2, 3, 8, 9)] == [1, 1, 2, 4, 5]


@pytest.mark.parametrize(
    ("prefetch", "taken", "waiting", "expected"),
    [
        (8, 3, 0, None),  # more than half of it still open
        (8, 4, 0, 12),  # half taken by held requests: opened with half again
        (8, 8, 3, 12),
        (8, 8, 4, None),  # the worker has half a window of work waiting: not now
        (12, 7, 0, None),
        (12, 8, 0, 12),
    ],
)
def test_opened_again_when_held_requests_took_half_and_the_worker_lacks_work(
    prefetch: int, taken: int, waiting: int, expected: int | None
) -> None:
    assert new_prefetch(prefetch=prefetch, taken=taken, window=8, waiting=waiting) == expected


def test_a_single_active_consumer_queue_is_named() -> None:
    queues = [Queue("a"), Queue("b", queue_arguments={"x-single-active-consumer": True})]
    assert single_active_queues(queues) == ["b"]


class TaskConsumer:
    """kombu's Consumer as the window uses it: qos, cancel, consume, its tags."""

    def __init__(self) -> None:
        self.queues = [Queue("q", queue_arguments={"x-queue-type": "quorum"})]
        self._active_tags: dict[str, str] = {}
        self.serial = 0
        self.calls: list[tuple[str, Any]] = []

    def qos(self, prefetch_count: int, apply_global: bool) -> None:
        self.calls.append(("qos", (prefetch_count, apply_global)))

    def cancel(self) -> None:
        self.calls.append(("cancel", None))
        self._active_tags.clear()

    def consume(self) -> None:
        self.serial += 1
        self._active_tags["q"] = f"tag{self.serial}"
        self.calls.append(("consume", None))


def message(tag: str) -> SimpleNamespace:
    return SimpleNamespace(delivery_info={"consumer_tag": tag})


def window_on(
    waiting: Callable[[], int], held: list[SimpleNamespace], *, recorded: bool = False
) -> tuple[ConsumerWindow, SimpleNamespace]:
    timer: list[tuple[float, Callable[[], None]]] = []
    transport = SimpleNamespace(driver_type="amqp")
    consumer = SimpleNamespace(
        initial_prefetch_count=8,
        qos_global=recorded,
        connection=SimpleNamespace(transport=transport),
        task_consumer=TaskConsumer(),
        timer=SimpleNamespace(call_after=lambda delay, fn, priority=0: timer.append((delay, fn))),
        due=timer,
    )
    window = ConsumerWindow(waiting=waiting, held_messages=lambda: held)
    window.start(consumer)
    consumer.task_consumer.consume()  # Celery's loop consumes after the steps started
    return window, consumer


def run_timer(consumer: SimpleNamespace) -> list[float]:
    due, consumer.due[:] = list(consumer.due), []
    for _, fn in due:
        fn()
    return [delay for delay, _ in due]


def test_held_requests_that_took_half_the_window_open_a_new_consumer() -> None:
    held: list[SimpleNamespace] = []
    window, consumer = window_on(lambda: 0, held)
    for _ in range(3):
        held.append(message("tag1"))
        window.held(held[-1])
    assert consumer.due == []  # 5 of 8 still open
    held.append(message("tag1"))
    window.held(held[-1])
    assert run_timer(consumer) == [0.0]  # on the loop's next turn, not inside the hold
    assert consumer.task_consumer.calls[1:] == [
        ("qos", (12, False)),
        ("cancel", None),
        ("consume", None),
    ]
    assert window.prefetch == 12 and window.taken == 0 and window.reopened == 1
    # The old consumer's held requests leave: the new one's count is not touched.
    window.left(held.pop())
    assert window.taken == 0
    for _ in range(8):
        held.append(message("tag2"))
        window.held(held[-1])
    run_timer(consumer)
    assert window.reopened == 2 and window.tags == frozenset({"tag3"})


def test_a_busy_worker_looks_again_later() -> None:
    busy = [True]
    held: list[SimpleNamespace] = []
    window, consumer = window_on(lambda: 4 if busy[0] else 0, held)
    for _ in range(4):
        held.append(message("tag1"))
        window.held(held[-1])
    assert run_timer(consumer) == [consumer_window.RECHECK]
    assert window.reopened == 0 and len(consumer.due) == 1  # still busy: again later
    busy[0] = False
    run_timer(consumer)
    run_timer(consumer)
    assert window.reopened == 1


def test_inactive_where_the_prefetch_raise_reaches_the_broker() -> None:
    held: list[SimpleNamespace] = []
    window, consumer = window_on(lambda: 0, held, recorded=True)  # global QoS
    for _ in range(8):
        held.append(message("tag1"))
        window.held(held[-1])
    assert consumer.due == [] and not window.active


def test_a_single_active_consumer_queue_is_warned_about_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    window, consumer = window_on(lambda: 0, [])
    consumer.task_consumer.queues = [Queue("s", queue_arguments={"x-single-active-consumer": True})]
    window.start(consumer)
    window.start(consumer)
    assert not window.active
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "s has a single active consumer" in warned[0], warned
