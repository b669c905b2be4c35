"""Whether a call's message waits in the broker: for ``baton cancel``, which says so,
and for ``baton.cancel`` of a ``unique`` call, which frees the key of a call whose
message waits in a queue (its start, later, reads the cancel).

A cancel by id is accepted for any id (a call may be published after its cancel), and
Celery's result of a call that waits is PENDING, the same as that of an id never
published: a mistyped id was "cancelled" in the same words as a queued call. So the
command looks for the id in kombu's Redis transport, in one script run on the broker:
in the lists of every queue the app declares (each priority step), and among the
messages delivered and not acked (``unacked``: held by a worker, a countdown or ETA
waiting, a run under ``acks_late``). A queue or hash longer than :data:`SCAN_MAX` is
not read (nothing is said). On other brokers nothing can be read without taking the
message: nothing is said either.
"""

from __future__ import annotations

import base64
import json
from typing import Any

from kombu.serialization import loads, prepare_accept_content

from celery_baton import internals
from celery_baton.worker.transport.broker import read_broker

#: The longest queue (or unacked hash) read for the id.
SCAN_MAX = 10_000

#: Where the message was found: in a queue, or delivered to a worker and not acked.
QUEUED = "queued"
DELIVERED = "delivered"

# KEYS: the unacked hash, then the queue lists. ARGV: the task id, SCAN_MAX.
# {1, the message}: in a queue; 3: delivered, not acked; 0: not there; 2: too long to tell.
_FIND = """
local most = tonumber(ARGV[2])
if redis.call('HLEN', KEYS[1]) > most then return 2 end
for _, item in ipairs(redis.call('HVALS', KEYS[1])) do
  if string.find(item, ARGV[1], 1, true) then return 3 end
end
for i = 2, #KEYS do
  if redis.call('LLEN', KEYS[i]) > most then return 2 end
  for _, item in ipairs(redis.call('LRANGE', KEYS[i], 0, -1)) do
    if string.find(item, ARGV[1], 1, true) then return {1, item} end
  end
end
return 0
"""
_FOUND = {0: "", 1: QUEUED, 3: DELIVERED}


def queued(app: Any, task_id: str) -> str | None:
    """Where ``task_id``'s message is in the broker: :data:`QUEUED`, :data:`DELIVERED`
    (to a worker that holds it, or runs it under ``acks_late``), '' (not there); None:
    not known (not kombu's Redis transport, a queue too long to read)."""
    found = _find(app, task_id)
    return None if found is None else found[0]


def queued_message(app: Any, task_id: str) -> dict[str, Any] | None:
    """``task_id``'s message (kombu's, as the Redis transport keeps it) when it waits in
    one of the app's queues, not delivered to any worker; else None (elsewhere, not
    there, or not known)."""
    found = _find(app, task_id)
    if found is None or found[0] != QUEUED or found[1] is None:
        return None
    message = json.loads(found[1])
    if not isinstance(message, dict):
        return None
    # The message may hold the id elsewhere than as its own (a link's, a parent's).
    headers = message.get("headers") or {}
    return message if isinstance(headers, dict) and headers.get("id") == task_id else None


def _find(app: Any, task_id: str) -> tuple[str, bytes | None] | None:
    if not read_broker(app).kombu_redis:
        return None
    with app.connection_for_write() as connection:
        # Once, not Celery's 100 retries: the cancel is made, this only says more.
        connection.ensure_connection(max_retries=1, interval_start=0, interval_step=0)
        channel = connection.default_channel
        unacked = getattr(channel, "unacked_key", None)
        names = [queue.name for queue in app.amqp.queues.values()]
        lists = internals.priority_lists(channel, names)
        if not isinstance(unacked, str) or lists is None:
            return None
        with channel.conn_or_acquire() as client:
            reply = client.eval(_FIND, 1 + len(lists), unacked, *lists, task_id, SCAN_MAX)
    if isinstance(reply, list):
        return QUEUED, reply[1]
    where = _FOUND.get(int(reply))
    return None if where is None else (where, None)


def message_call(app: Any, message: dict[str, Any]) -> tuple[str, Any, Any, dict[str, Any]] | None:
    """The task name, args, kwargs and headers of a Celery message (protocol 2) as
    kombu's Redis transport keeps it; None when it is not one."""
    headers = message.get("headers")
    properties = message.get("properties") or {}
    if not isinstance(headers, dict) or not isinstance(headers.get("task"), str):
        return None
    body = message.get("body")
    if properties.get("body_encoding") == "base64" and isinstance(body, str):
        body = base64.b64decode(body)
    decoded = decode_body(app, body, message.get("content-type"), message.get("content-encoding"))
    if not isinstance(decoded, list | tuple) or len(decoded) < 2:
        return None
    return headers["task"], decoded[0], decoded[1], headers


def decode_body(app: Any, body: Any, content_type: Any, content_encoding: Any) -> Any:
    """A Celery message's body decoded as the worker's trace decodes it (the app's
    ``accept_content``); ``body`` as it is when there is no content type."""
    if not content_type:
        return body
    accept = prepare_accept_content(app.conf.accept_content)  # type: ignore[no-untyped-call]
    return loads(body, content_type, content_encoding, accept=accept)  # type: ignore[no-untyped-call]
