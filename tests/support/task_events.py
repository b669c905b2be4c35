"""A real Celery event receiver in a thread: what ``celery events`` and Flower would see.

Example::

    with EventCapture(broker_url) as events:
        ...  # publish
        event = events.wait_for("task-baton-held", task_id)
"""

from __future__ import annotations

import threading
import time
from typing import Any

from celery import Celery


class EventCapture:
    """Captures every event on the broker's event exchange from the moment it is entered."""

    def __init__(self, broker_url: str) -> None:
        self.app = Celery("event-capture", broker=broker_url)
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._receiver: Any = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._probe = f"probe-{id(self)}-{time.monotonic_ns()}"
        self._heard = threading.Event()

    def __enter__(self) -> EventCapture:
        ready = self._ready

        class Receiver(self.app.events.Receiver):  # type: ignore[misc,name-defined]
            def on_consume_ready(self, *args: Any, **kwargs: Any) -> None:
                ready.set()  # its queue is bound: nothing sent from now on is missed

        connection = self.app.connection_for_read()
        self._receiver = Receiver(connection, handlers={"*": self._on_event}, app=self.app)
        self._thread = threading.Thread(target=self._run, args=(connection,), daemon=True)
        self._thread.start()
        if not self._ready.wait(20):
            raise AssertionError(f"the event receiver did not start: {self._error!r}")
        self._until_subscribed()
        return self

    def _until_subscribed(self) -> None:
        """Until an event sent now arrives. On a Redis broker the receiver's queue is
        ready (``on_consume_ready``) before kombu's loop has SUBSCRIBEd to the event
        exchange: what a worker sent in between was lost (a loaded run missed a
        ``task-started`` sent right after the capture was entered). The probes are not
        kept."""
        deadline = time.monotonic() + 20
        with self.app.events.default_dispatcher() as dispatcher:
            while not self._heard.is_set():
                if self._error is not None or time.monotonic() > deadline:
                    raise AssertionError(f"the event receiver hears nothing: {self._error!r}")
                dispatcher.send("task-probe", uuid=self._probe)
                self._heard.wait(0.05)

    def _run(self, connection: Any) -> None:
        try:
            with connection:
                self._receiver.capture(limit=None, timeout=None, wakeup=False)
        except BaseException as exc:  # reported by the test's wait, not lost in a thread
            self._error = exc

    def __exit__(self, *exc_info: object) -> None:
        self._receiver.should_stop = True
        assert self._thread is not None
        self._thread.join(5)

    def _on_event(self, event: dict[str, Any]) -> None:
        if event.get("uuid") == self._probe:
            self._heard.set()
            return
        with self._lock:
            self.events.append(event)

    def of(self, task_id: str) -> list[dict[str, Any]]:
        """The events of ``task_id``, in the order they arrived."""
        with self._lock:
            return [e for e in self.events if e.get("uuid") == task_id]

    def types(self, task_id: str) -> list[str]:
        return [e["type"] for e in self.of(task_id)]

    def baton_events(self) -> list[dict[str, Any]]:
        with self._lock:
            return [e for e in self.events if e["type"].startswith("task-baton-")]

    def wait_for(self, type_: str, task_id: str, timeout: float = 20) -> dict[str, Any]:
        """The first ``type_`` event of ``task_id``, waiting for it up to ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            for event in self.of(task_id):
                if event["type"] == type_:
                    return event
            if self._error is not None:
                raise AssertionError(f"the event receiver failed: {self._error!r}")
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"no {type_} event of {task_id} within {timeout} s; "
                    f"its events: {self.types(task_id)}"
                )
            time.sleep(0.05)
