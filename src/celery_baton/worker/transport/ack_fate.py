"""Whether the message of a run whose ack failed comes back: asked of the broker.

An ack that timed out is not an ack that did not happen. A redis-server that was
stopped (SIGSTOP, a long fork, a VM paused) reads the timed-out command when it goes
on and runs it: the message is gone for good, and no copy will come. Or it never read
it (it was killed, the connection broke first), or kombu restored the message before
the late ack ran (the consumer's channel closed and gave back what it held, or the
visibility sweep): then the message is unacked or back in a queue, and a copy runs.

The worker keeps a unique claim for that copy (``Releasing.finish``). Kept for nothing,
it deduplicates every publish of the key into a task that ended, for the whole
redelivery window (twice the ``visibility_timeout`` and kombu's restore period and mutex:
about two hours by default). So, once the
broker answers again, :class:`AckFates` asks it where the message is, in one script run
atomically on the broker (after a ``PING`` answered: every command the broker had read
before, the late ack among them, has then run):

* its delivery tag in kombu's unacked hash: not acked, it comes back;
* its task id in one of the queues its exchange routes to (a restored copy, before a
  worker took it): it comes back;
* neither: acked. The claim is freed (compared with its task id: never anyone else's).

A queue longer than :data:`SCAN_MAX` is not scanned (the claim is kept, as before). A
copy another worker has taken off the queue but not yet recorded as unacked (kombu's
``BRPOP``, then ``HSET``: a few milliseconds) is not seen: the one window left. Only
kombu's Redis transport is asked; on AMQP the broker requeues an unacked message when
it sees the channel close, and the copy does come.

Checks run on one thread, started on the first failed ack: the consumer's loop never
waits for the broker here.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from celery_baton import internals

logger = logging.getLogger("celery_baton.worker")

#: The longest queue scanned for a restored copy (longer: assumed to hold it).
SCAN_MAX = 10_000
#: Seconds between tries while the broker does not answer.
RETRY_EVERY = 1.0

# KEYS: the unacked hash, then every queue list the message may be restored to.
# ARGV: the delivery tag, the task id, SCAN_MAX.
# 1: unacked (comes back); 2: in a queue, or a queue too long to tell (comes back);
# 0: gone (acked).
_WHERE_IS = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return 1 end
local most = tonumber(ARGV[3])
for i = 2, #KEYS do
  if redis.call('LLEN', KEYS[i]) > most then return 2 end
  for _, item in ipairs(redis.call('LRANGE', KEYS[i], 0, -1)) do
    if string.find(item, ARGV[2], 1, true) then return 2 end
  end
end
return 0
"""


class Fate(enum.Enum):
    COMES_BACK = "comes back"
    ACKED = "acked"
    UNKNOWN = "not known"  # not kombu's Redis transport, or not readable


def where_is(message: Any, task_id: str) -> Fate:
    """Ask the broker whether ``message`` (whose ack failed) will be delivered again.

    Raises the transport's error when the broker does not answer (the caller retries)."""
    channel = getattr(message, "channel", None)
    qos = getattr(channel, "qos", None)
    unacked_key = getattr(qos, "unacked_key", None)
    if channel is None or unacked_key is None:
        return Fate.UNKNOWN
    info = message.delivery_info or {}
    lists = internals.queue_lists(channel, info.get("exchange"), info.get("routing_key"))
    if lists is None:  # a kombu without these: do not guess
        return Fate.UNKNOWN
    keys = internals.prefixed_keys(channel, [unacked_key, *lists])
    with channel.conn_or_acquire() as client:
        client.ping()  # the broker runs again: what it had read before has run
        found = client.eval(_WHERE_IS, len(keys), *keys, message.delivery_tag, task_id, SCAN_MAX)
    return Fate.ACKED if int(found) == 0 else Fate.COMES_BACK


@dataclass
class _Check:
    message: Any
    task_id: str
    until: float  # monotonic: past it, the kept claim has run out anyway
    on_acked: Callable[[], None]


class AckFates:
    """Asks the broker, off the consumer's loop, where failed acks' messages went."""

    def __init__(self, ask: Callable[[Any, str], Fate] = where_is) -> None:
        self._ask = ask
        self._checks: queue.Queue[_Check] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def check(
        self, message: Any, task_id: str, within: float, on_acked: Callable[[], None]
    ) -> None:
        """Call ``on_acked`` (on this class's thread) if the broker shows that
        ``message`` was acked after all; asked until it answers, for ``within`` s."""
        self._checks.put(_Check(message, task_id, time.monotonic() + within, on_acked))
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="baton-ack-fates", daemon=True
                )
                self._thread.start()

    def _run(self) -> None:
        waiting: list[_Check] = []
        while True:
            if not waiting:
                waiting.append(self._checks.get())
            while True:
                try:
                    waiting.append(self._checks.get_nowait())
                except queue.Empty:
                    break
            waiting = [check for check in waiting if not self._settle(check)]
            if waiting:
                time.sleep(RETRY_EVERY)

    def _settle(self, check: _Check) -> bool:
        """True when ``check`` needs no more tries."""
        if time.monotonic() > check.until:
            return True  # the kept claim ran out: nothing left to free
        try:
            fate = self._ask(check.message, check.task_id)
        except Exception as exc:  # the broker still does not answer: later
            logger.debug("baton: asking the broker about %s: %s", check.task_id, exc)
            return False
        if fate is Fate.ACKED:
            logger.warning(
                "baton: the broker ran the ack of %s after all: its message will not come "
                "back; its unique key is freed",
                check.task_id,
            )
            try:
                check.on_acked()
            except Exception:
                logger.exception("baton: freeing the unique key of %s failed", check.task_id)
        return True
