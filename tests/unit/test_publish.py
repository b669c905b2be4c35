"""Which message a publish's claim belongs to: read from the message Celery built."""

from __future__ import annotations

import time
from collections import namedtuple
from typing import Any

import pytest
from celery import Celery
from celery._state import _task_stack

from celery_baton.core.policy.headers import BEAT_SLOT_HEADER, PUBLISH_HEADER, stamp_time
from celery_baton.publish import _message_id, _stamp_publish

Message = namedtuple("Message", "headers properties body sent_event")


def test_protocol_2_carries_the_id_in_the_headers() -> None:
    assert _message_id(Message({"id": "abc", "task": "t"}, {}, ((), {}, {}), None)) == "abc"


def test_protocol_1_carries_the_id_in_the_body() -> None:
    assert _message_id(Message({}, {}, {"id": "abc", "task": "t"}, None)) == "abc"


def test_anything_else_has_no_id() -> None:
    assert _message_id(Message(None, {}, "raw", None)) is None
    assert _message_id(object()) is None


def _stamped(**options: Any) -> Any:
    _stamp_publish(options)
    return (options.get("headers") or {}).get(PUBLISH_HEADER)


def test_every_publish_is_stamped_with_a_stamp_of_its_own() -> None:
    first, second = _stamped(task_id="x"), _stamped(task_id="x")
    assert isinstance(first, str) and first != second
    # it says when it was published (a cancel by key cancels calls published until it)
    sent = stamp_time(first)
    assert sent is not None and abs(sent - time.time() * 1000) < 60_000
    headers = {"mine": 1}
    options: dict[str, Any] = {"headers": headers}
    _stamp_publish(options)
    assert headers == {"mine": 1}  # the caller's dict is left alone
    assert options["headers"]["mine"] == 1


def test_a_stamp_given_or_a_beat_slot_is_left_as_it_is() -> None:
    assert _stamped(headers={PUBLISH_HEADER: "given"}) == "given"
    assert _stamped(headers={BEAT_SLOT_HEADER: 1}) is None


@pytest.fixture
def app() -> Any:
    app = Celery("stamps", set_as_current=False)
    yield app
    app.close()


def test_a_retry_keeps_its_runs_stamp_and_a_replacement_gets_a_new_one(app: Any) -> None:
    """Inside a running task (its request pushed as Celery does): its retry continues its
    publish; a replacement (same id, one level deeper), or another task id, is new."""
    seen: dict[str, Any] = {}

    @app.task(bind=True)
    def work(self: Any) -> None:
        seen["retry"] = _stamped(task_id="id-1", retries=3, replaced_task_nesting=1)
        seen["replace"] = _stamped(task_id="id-1", retries=0, replaced_task_nesting=2)
        seen["other"] = _stamped(task_id="id-2", retries=3, replaced_task_nesting=1)

    work.push_request(id="id-1", retries=2, replaced_task_nesting=1, **{PUBLISH_HEADER: "run"})
    _task_stack.push(work)  # what Celery's tracer does around a run: `current_task`
    try:
        work.run()
    finally:
        _task_stack.pop()
        work.pop_request()
    assert seen["retry"] == "run"
    assert seen["replace"] not in (None, "run")
    assert seen["other"] not in (None, "run")


def test_an_ordered_call_takes_no_eta_or_countdown() -> None:
    from celery_baton.errors import ConfigError
    from celery_baton.publish import _check_ordered_call

    _check_ordered_call("bank.apply_event", {"task_id": "x"})
    for option in ({"countdown": 5}, {"eta": time.time()}, {"countdown": 0}):
        with pytest.raises(ConfigError, match=r"bank\.apply_event: an ordered call takes no eta"):
            _check_ordered_call("bank.apply_event", {"task_id": "x", **option})
