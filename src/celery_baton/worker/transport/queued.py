"""Whether a call's message waits in the broker: for ``baton cancel``, which says so.

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

from typing import Any

from celery_baton import internals
from celery_baton.worker.transport.broker import read_broker

#: The longest queue (or unacked hash) read for the id.
SCAN_MAX = 10_000

#: Where the message was found: in a queue, or delivered to a worker and not acked.
QUEUED = "queued"
DELIVERED = "delivered"

# KEYS: the unacked hash, then the queue lists. ARGV: the task id, SCAN_MAX.
# 1: in a queue; 3: delivered, not acked; 0: not there; 2: too long to tell.
_FIND = """
local most = tonumber(ARGV[2])
if redis.call('HLEN', KEYS[1]) > most then return 2 end
for _, item in ipairs(redis.call('HVALS', KEYS[1])) do
  if string.find(item, ARGV[1], 1, true) then return 3 end
end
for i = 2, #KEYS do
  if redis.call('LLEN', KEYS[i]) > most then return 2 end
  for _, item in ipairs(redis.call('LRANGE', KEYS[i], 0, -1)) do
    if string.find(item, ARGV[1], 1, true) then return 1 end
  end
end
return 0
"""
_FOUND = {0: "", 1: QUEUED, 3: DELIVERED}


def queued(app: Any, task_id: str) -> str | None:
    """Where ``task_id``'s message is in the broker: :data:`QUEUED`, :data:`DELIVERED`
    (to a worker that holds it, or runs it under ``acks_late``), '' (not there); None:
    not known (not kombu's Redis transport, a queue too long to read)."""
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
            found = int(client.eval(_FIND, 1 + len(lists), unacked, *lists, task_id, SCAN_MAX))
    return _FOUND.get(found)
