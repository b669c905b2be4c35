"""A batched call as the store keeps it: encoded from its message's own JSON body (or
from its arguments when the message is not JSON), decoded to the same call."""

from __future__ import annotations

import datetime
import decimal
import uuid
from types import SimpleNamespace
from typing import Any

from kombu.utils import json as kombu_json

from celery_baton.worker.pool.batch_run import decode_call, encode_call, encode_request_call

ARGS = (1, "two", [3, {"four": 4}], None)
KWARGS: dict[str, Any] = {
    "when": datetime.datetime(2026, 11, 29, 10, 0, tzinfo=datetime.timezone.utc),
    "amount": decimal.Decimal("1.10"),
    "ref": uuid.UUID("12345678-1234-5678-1234-567812345678"),
    "empty": [],
    "nested": {"a": [], "b": {}},
}
CONTEXT = SimpleNamespace(root_id="root", parent_id=None, retries=2, callbacks=[{"task": "t"}])
#: The same request's headers (its request dict); its callbacks are in its body's embed.
HEADERS = {"root_id": "root", "parent_id": None, "retries": 2, "task": "batched"}
EMBED = {"callbacks": [{"task": "t"}], "errbacks": None, "chain": None, "chord": None}


def _request(body: Any, content_type: str = "application/json") -> SimpleNamespace:
    return SimpleNamespace(
        body=body,
        content_type=content_type,
        content_encoding="utf-8",
        args=ARGS,
        kwargs=KWARGS,
        request_dict=HEADERS,
        _context=CONTEXT,
    )


def test_a_json_message_s_body_is_kept_as_it_came_and_decodes_to_the_call() -> None:
    body = kombu_json.dumps([list(ARGS), KWARGS, EMBED]).encode()
    encoded = encode_request_call(_request(body))
    assert body.decode() in encoded  # not encoded again
    call, canvas = decode_call("task-id", encoded)
    assert (call.args, call.kwargs) == (ARGS, KWARGS)
    assert canvas == {"root_id": "root", "retries": 2, "callbacks": [{"task": "t"}]}


def test_both_forms_decode_to_the_same_call() -> None:
    body = kombu_json.dumps([list(ARGS), KWARGS, EMBED]).encode()
    from_body = decode_call("id", encode_request_call(_request(body)))
    from_args = decode_call("id", encode_call(ARGS, KWARGS, CONTEXT))
    assert from_body == from_args


def test_a_message_that_is_not_json_is_encoded_from_its_arguments() -> None:
    encoded = encode_request_call(_request(b"\x80\x04pickled", "application/x-python-serialize"))
    assert encoded == encode_call(ARGS, KWARGS, CONTEXT)
    encoded = encode_request_call(_request((ARGS, KWARGS, {})))  # a protocol 1 body
    assert encoded == encode_call(ARGS, KWARGS, CONTEXT)
