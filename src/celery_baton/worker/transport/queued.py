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
import time
from collections.abc import Callable
from typing import Any, TypeVar

from kombu.compression import decompress
from kombu.serialization import loads, prepare_accept_content

from celery_baton import internals
from celery_baton.worker.transport.broker import read_broker

_Reply = TypeVar("_Reply")

#: The longest queue (or unacked hash) read for the id.
SCAN_MAX = 10_000
#: The most messages one look brings back (a cancel by key of a task with more queued
#: calls frees the keys of these; the others' when a worker discards them).
RETURNED_MAX = 1_000

#: Seconds a look waits for the broker at most (connecting, and for its answer).
LOOK_TIMEOUT = 1.0
#: Seconds after a look the broker did not answer during which it is not asked again
#: (each cancel meanwhile would wait LOOK_TIMEOUT for nothing).
QUIET_AFTER_FAILURE = 10.0
_failed_at = -QUIET_AFTER_FAILURE  # monotonic time of the last look that failed


class BrokerNotAsked(Exception):
    """A look not made: the broker did not answer one moments ago."""


#: Where the message was found: in a queue, or delivered to a worker and not acked.
QUEUED = "queued"
DELIVERED = "delivered"

# KEYS: the unacked hash, then the queue lists. ARGV: what a message holds (a task id,
# a task's name), SCAN_MAX, RETURNED_MAX, '1' to look among the unacked too. {1 (3: an
# unacked one holds it too), message...}: in a queue (each message that holds it, in
# queue order); 3: delivered, not acked; 0: not there; 2: too long to tell.
_FIND = """
local most, returned = tonumber(ARGV[2]), tonumber(ARGV[3])
local found = {1}
for i = 2, #KEYS do
  if redis.call('LLEN', KEYS[i]) > most then return 2 end
  for _, item in ipairs(redis.call('LRANGE', KEYS[i], 0, -1)) do
    if string.find(item, ARGV[1], 1, true) and #found <= returned then
      found[#found + 1] = item
    end
  end
end
local delivered = 0
if ARGV[4] == '1' then
  if redis.call('HLEN', KEYS[1]) > most then return 2 end
  for _, item in ipairs(redis.call('HVALS', KEYS[1])) do
    if string.find(item, ARGV[1], 1, true) then delivered = 3 break end
  end
end
if #found > 1 then
  found[1] = math.max(1, delivered)
  return found
end
return delivered
"""
_FOUND = {0: "", 3: DELIVERED}


def queued(app: Any, task_id: str) -> str | None:
    """Where ``task_id``'s message is in the broker: :data:`QUEUED`, :data:`DELIVERED`
    (to a worker that holds it, or runs it under ``acks_late``), '' (not there); None:
    not known (not kombu's Redis transport, a queue too long to read)."""
    found = _find(app, task_id, unacked=True)
    if isinstance(found, tuple):
        messages, delivered = found
        return QUEUED if _own(messages, "id", task_id) else (DELIVERED if delivered else "")
    return found


def queued_message(app: Any, task_id: str) -> dict[str, Any] | None:
    """``task_id``'s message (kombu's, as the Redis transport keeps it) when it waits in
    one of the app's queues, not delivered to any worker; else None (elsewhere, not
    there, or not known)."""
    found = _find(app, task_id, unacked=False)
    own = _own(found[0], "id", task_id) if isinstance(found, tuple) else []
    return own[0] if own else None


def delivered_messages(app: Any, header: str, value: str) -> list[dict[str, Any]] | None:
    """The messages whose ``header`` is ``value`` (``id``: a task id; ``task``: a task's
    name) among those delivered to a worker and not acked (kombu's Redis transport: in a
    worker's prefetch, held, waiting for a countdown, or running under ``acks_late``);
    at most :data:`RETURNED_MAX`. None: not known."""

    def look(channel: Any, client: Any) -> list[Any] | None:
        unacked_key = getattr(channel, "unacked_key", None)
        if not isinstance(unacked_key, str):
            return None
        (key,) = internals.prefixed_keys(channel, [unacked_key])
        return list(client.eval(_FIND_DELIVERED, 1, key, value, SCAN_MAX, RETURNED_MAX))

    found = _asked(app, look)
    if found is None:
        return None
    # Each value is kombu's [message, exchange, routing key].
    return _own_of([json.loads(raw)[0] for raw in found], header, value)


# KEYS: the unacked hash. ARGV: what a message holds (a task id, a task's name),
# SCAN_MAX, RETURNED_MAX. The values that hold it (at most RETURNED_MAX); none when the
# hash is longer than SCAN_MAX.
_FIND_DELIVERED = """
local found = {}
if redis.call('HLEN', KEYS[1]) > tonumber(ARGV[2]) then return found end
for _, item in ipairs(redis.call('HVALS', KEYS[1])) do
  if string.find(item, ARGV[1], 1, true) and #found < tonumber(ARGV[3]) then
    found[#found + 1] = item
  end
end
return found
"""


def queued_messages_of(app: Any, task: str) -> list[dict[str, Any]] | None:
    """The messages of calls of ``task`` that wait in the app's queues, not delivered
    to any worker (at most :data:`RETURNED_MAX`); None: not known."""
    found = _find(app, task, unacked=False)
    if isinstance(found, tuple):
        return _own(found[0], "task", task)
    return None if found is None else []


def _own(messages: list[bytes], header: str, value: str) -> list[dict[str, Any]]:
    """Those of ``messages`` whose ``header`` is ``value`` (a message may hold an id as
    a link's or a parent's, a task's name in its arguments)."""
    return _own_of([json.loads(raw) for raw in messages], header, value)


def _own_of(messages: list[Any], header: str, value: str) -> list[dict[str, Any]]:
    """:func:`_own` of messages already read."""
    own = []
    for message in messages:
        headers = message.get("headers") if isinstance(message, dict) else None
        if isinstance(headers, dict) and headers.get(header) == value:
            own.append(message)
    return own


def _find(app: Any, needle: str, *, unacked: bool) -> tuple[list[bytes], bool] | str | None:
    """``(the queued messages that hold needle, whether an unacked one holds it too)``,
    else where one is: DELIVERED (looked for when ``unacked``), '' (nowhere); None: not
    known (not kombu's Redis transport, a queue too long to read)."""

    def look(channel: Any, client: Any) -> Any:
        unacked_key = getattr(channel, "unacked_key", None)
        lists = internals.priority_lists(channel, queue_names(app))
        if not isinstance(unacked_key, str) or lists is None:
            return None
        keys = internals.prefixed_keys(channel, [unacked_key, *lists])
        return client.eval(
            _FIND, len(keys), *keys, needle, SCAN_MAX, RETURNED_MAX, "1" if unacked else "0"
        )

    reply = _asked(app, look)
    if reply is None:
        return None
    if isinstance(reply, list):
        return list(reply[1:]), int(reply[0]) == 3
    return _FOUND.get(int(reply))


def _asked(app: Any, look: Callable[[Any, Any], _Reply]) -> _Reply | None:
    """``look(channel, client)`` on the app's broker, once; None when it is not kombu's
    Redis transport. A broker that failed a look moments ago is not asked again
    (``BrokerNotAsked``); a broker that hangs (paused, overloaded) must not hold the
    cancel, already made: its socket waits LOOK_TIMEOUT at most (kombu's own timeouts
    are none by default)."""
    global _failed_at
    if not read_broker(app).kombu_redis:
        return None
    if time.monotonic() - _failed_at < QUIET_AFTER_FAILURE:
        raise BrokerNotAsked(
            f"the broker did not answer a look {time.monotonic() - _failed_at:.1f}s ago: "
            f"not asked again for {QUIET_AFTER_FAILURE:.0f}s"
        )
    timeouts = {"socket_timeout": LOOK_TIMEOUT, "socket_connect_timeout": LOOK_TIMEOUT}
    try:
        with app.connection_for_write(transport_options=timeouts) as connection:
            # Once, not Celery's 100 retries: the cancel is made, this only says more.
            connection.ensure_connection(max_retries=1, interval_start=0, interval_step=0)
            channel = connection.default_channel
            with channel.conn_or_acquire() as client:
                return look(channel, client)
    except Exception:
        _failed_at = time.monotonic()
        raise


def queue_names(app: Any) -> list[str]:
    """Every queue a call of ``app`` may wait in: the queues this process knows (declared,
    and those it routed a publish to) and where each task routes (its ``queue=``, the
    ``task_routes`` it matches without arguments), which a process that never published
    it (the one that cancels, say) does not know."""
    names = {queue.name for queue in app.amqp.queues.values()}
    names.add(app.conf.task_default_queue)
    router = app.amqp.router
    for name, task in list(app.tasks.items()):
        if getattr(task, "queue", None):
            names.add(_queue_name(task.queue))
        try:
            route = router.lookup_route(name, (), {}, {}, task)
        except Exception:  # a route function of the app's that needs the call's arguments
            continue
        if isinstance(route, dict):
            route = route.get("queue")
        if route:
            names.add(_queue_name(route))
    names.discard("")
    return sorted(names)


def _queue_name(queue: Any) -> str:
    name = getattr(queue, "name", queue)
    return name if isinstance(name, str) else ""


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
    compression = headers.get("compression")
    if compression:  # task_compression: kombu's Message decompresses as it is built
        body = decompress(body, compression)  # type: ignore[no-untyped-call]
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
