"""Which message a publish's claim belongs to: read from the message Celery built."""

from __future__ import annotations

from collections import namedtuple

from celery_baton.publish import _message_id

Message = namedtuple("Message", "headers properties body sent_event")


def test_protocol_2_carries_the_id_in_the_headers() -> None:
    assert _message_id(Message({"id": "abc", "task": "t"}, {}, ((), {}, {}), None)) == "abc"


def test_protocol_1_carries_the_id_in_the_body() -> None:
    assert _message_id(Message({}, {}, {"id": "abc", "task": "t"}, None)) == "abc"


def test_anything_else_has_no_id() -> None:
    assert _message_id(Message(None, {}, "raw", None)) is None
    assert _message_id(object()) is None
