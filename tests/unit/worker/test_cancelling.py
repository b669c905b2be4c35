"""worker/cancelling: a cancel by key learned while the worker holds calls of its key
(one waiting for a busy pool among them) is told, by id, to whatever starts their jobs;
the real-process behaviour is in tests/cancel/test_cancel_paths.py."""

from __future__ import annotations

import time
from typing import Any

import pytest
from celery.worker import state as worker_state

from celery_baton.core.cancels import KeyCancel, cancel_notice, key_material
from celery_baton.core.keys import KeyNames
from celery_baton.core.shared_cancels import SharedCancels
from celery_baton.worker.cancelling import Cancelling, exception_of, revoke_refused_starts
from celery_baton.worker.pool.cancel_start import CancelledAtStart

NAMES = KeyNames("baton")


def keyed(account_id: int, n: int) -> None: ...


class Task:
    run = staticmethod(keyed)


class Request:
    # As Celery's Request: named slots and a __dict__ (a class the swap can extend).
    __slots__ = ("__dict__", "__weakref__", "id")

    def __init__(self, task_id: str, name: str, *args: Any) -> None:
        self.id = task_id
        self.name = name
        self.task = Task()
        self.args = args
        self.kwargs: dict[str, Any] = {}
        self.request_dict: dict[str, Any] = {}


class Records:
    names = NAMES


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    requests: dict[str, Any] = {}
    monkeypatch.setattr(worker_state, "requests", requests)
    return requests


def _cancelling(noticed: SharedCancels) -> Cancelling:
    """A worker's cancels on one store (in the gate), writing to ``noticed``."""
    return Cancelling(
        Records(),  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        keep_noticed=60,
        generation=lambda: 0,
        in_gate=True,
        noticed=noticed,
    )


def test_a_key_cancel_marks_the_held_calls_it_covers(held: dict[str, Any]) -> None:
    noticed = SharedCancels()
    cancelling = _cancelling(noticed)
    seven, eight, other = (
        Request("a", "t", 7, 1),
        Request("b", "t", 8, 1),
        Request("c", "u", 7, 1),
    )
    held.update({r.id: r for r in (seven, eight, other)})
    cancel = KeyCancel(int(time.time() * 1000), key_material("t", {"account_id": 7}))
    text = cancel_notice(NAMES.cancels, "key", 30_000, f"t\n{cancel.member}")
    assert cancelling.notice(text)
    until = noticed.find("a")
    assert until is not None and until > time.monotonic() + 20  # trusted while it lives
    assert noticed.find("b") is None and noticed.find("c") is None


def test_an_id_notice_marks_the_held_call_of_that_id(held: dict[str, Any]) -> None:
    noticed = SharedCancels()
    cancelling = _cancelling(noticed)
    call = Request("a", "t", 7, 1)
    held[call.id] = call
    assert cancelling.notice(cancel_notice(NAMES.cancels, "id", 30_000, "a"))
    assert noticed.find("a") == 0.0  # by id: asked of the store where it starts


def test_a_request_whose_start_refused_it_is_revoked_any_other_failure_is_celerys() -> None:
    """Whoever found the cancel (a notice, a match by key, the store asked at the start),
    the refused start's ``CancelledAtStart`` revokes the request; every other failure
    goes to the class's own handler, and installing twice wraps once."""
    from billiard.einfo import ExceptionInfo

    handled: list[str] = []

    class CeleryRequest:
        def on_failure(
            self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False
        ) -> str:
            handled.append(type(exception_of(exc_info)).__name__)
            return "celery"

        def revoked(self) -> None:
            handled.append("revoked")

    class TaskRequest(CeleryRequest):  # as each task's class made by Celery
        id = "a"
        name = "t"

    revoke_refused_starts(CeleryRequest)
    revoke_refused_starts(CeleryRequest)

    def failed(exc: BaseException) -> Any:
        try:
            raise exc
        except BaseException:
            return ExceptionInfo()

    try:
        assert TaskRequest().on_failure(failed(CancelledAtStart("a", "cancelled by id"))) is None
        assert handled == ["revoked"] and "a" in worker_state.revoked
        assert TaskRequest().on_failure(failed(ValueError("boom"))) == "celery"
        assert handled == ["revoked", "ValueError"]
    finally:
        worker_state.revoked.discard("a")
