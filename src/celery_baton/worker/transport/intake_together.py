"""Taking a worker's messages from a Redis broker several at a time.

kombu's Redis transport takes messages in one at a time: a ``BRPOP`` answered with one
message, then a ``MULTI ZADD HSET EXEC`` of its own that records it unacknowledged
(``QoS.append``), two round trips per message on the consumer's one thread. That, not
the tasks' work, bounded how fast a worker drained short tasks (the main process is a
drain's bottleneck: docs/benchmarks.md#issue-36-eleventh), and batched calls, one
message each (docs/benchmarks.md#batching, bound 1). Here, when a
``BRPOP`` answers, up to the prefetch window's room more are taken from the same list
in one script call (``lua/intake.lua``) that records each in kombu's unacked index and
hash as it pops it, and they are handed to the consumer one after the other, as if
each ``BRPOP`` had answered with them; kombu's own record of each (``QoS.append``) then
keeps only its in-memory books. The window bounds them as it bounds kombu's: they are
counted delivered as they are handed over, and no more are taken than it has room for.

Order and priority are kombu's: the script pops from the list the ``BRPOP`` answered
from (its priority's list), whose messages it would have taken next; the rotation
between queues moves on by one ``BRPOP`` as before, so a busy queue can take at most
one window's room ahead of the others. Nothing is lost in between: a message popped is
recorded unacked in the same script (kombu's pop and record are two steps), so a worker
killed there leaves it to the visibility timeout's restore, as it leaves its delivered
messages. A message that could not be handed over (the delivery before it raised) is
put back at the head of its list.

Every worker whose task channel is kombu's Redis transport's takes its messages so
(``install``, at each consumer start); other transports keep kombu's intake as it is,
and so does a channel whose ``can_consume`` was narrowed beyond its window (Celery's
``worker_disable_prefetch``: no more requests than the pool runs).
A payload the script cannot read goes back to its list, and kombu's ``BRPOP`` takes it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from importlib import resources
from typing import Any

from celery_baton import internals

logger = logging.getLogger("celery_baton.worker")

#: At most this many messages taken in one script call (with a window that large).
INTAKE_MAX = 100

_INSTALLED_ATTR = "_baton_intake_together"


def _script_text() -> str:
    return resources.files("celery_baton.worker.transport").joinpath("lua/intake.lua").read_text()


def _redis_channel(channel: Any) -> bool:
    try:
        from kombu.transport.redis import Channel
    except ImportError:  # redis-py absent: not that transport
        return False
    return isinstance(channel, Channel)


def install(channel: Any, window: Callable[[], int] | None = None, most: int = INTAKE_MAX) -> bool:
    """Make ``channel`` (the consumer's task channel) take several messages per
    ``BRPOP`` answer; False when it is not kombu's Redis transport's or not shaped as
    this module knows it (kombu's intake is then kept). ``window()``: the prefetch count
    the consumer has set for its loop's next turn (Celery's ``consumer.qos.value``: a
    held call raises it by one, and the channel's count follows a turn later)."""
    if channel is None or not _redis_channel(channel):
        return False
    if getattr(channel, _INSTALLED_ATTR, False):
        return True
    handlers: Any = getattr(channel, "handlers", None)
    qos = getattr(channel, "qos", None)
    client = getattr(channel, "client", None)
    read_one = handlers.get("BRPOP") if isinstance(handlers, dict) else None
    if read_one is None or qos is None or not callable(getattr(client, "parse_response", None)):
        logger.info("baton: kombu's Redis channel is not as expected; messages taken one by one")
        return False
    intake = _Intake(channel, qos, client, most, window)
    handlers["BRPOP"] = intake.read
    setattr(channel, _INSTALLED_ATTR, True)
    return True


def _envelope(text: str, kombu_loads: Callable[[str], Any]) -> Any:
    """A message's envelope as kombu's ``loads`` reads it: without its marker of an
    encoded type (``__type__``: a date, a UUID...), the JSON as it is, read without
    kombu's hook on every object (a tenth of a batching worker's intake)."""
    if "__type__" in text:
        return kombu_loads(text)
    return json.loads(text)


class _Intake:
    """One channel's intake: kombu's ``BRPOP`` handler, then the more taken beside it."""

    def __init__(
        self, channel: Any, qos: Any, client: Any, most: int, window: Callable[[], int] | None
    ) -> None:
        self.channel = channel
        self.window = window
        self.qos = qos
        self.most = most
        self.read_one = channel.handlers["BRPOP"]
        self.script = client.register_script(_script_text())
        # kombu's global_keyprefix: its client prefixes the first key of an EVALSHA only,
        # and spells a bytes key as "b'...'"; the script runs on a plain client of the
        # same connections instead, with every key prefixed here.
        self.script_client: Any = None  # None: the channel's own client
        if internals.key_prefix(channel):
            import redis

            self.script_client = redis.Redis(connection_pool=client.connection_pool)
        self._answered: list[Any] = []  # the list key the BRPOP being read answered from
        self._recorded: set[str] = set()  # tags the script recorded, not handed over yet
        parse_response = client.parse_response

        def noting_parse_response(connection: Any, command: Any, **options: Any) -> Any:
            reply = parse_response(connection, command, **options)
            if command == "BRPOP" and reply:
                self._answered.append(reply[0])
            return reply

        client.parse_response = noting_parse_response
        append = qos.append

        def append_unless_recorded(message: Any, delivery_tag: Any) -> Any:
            if delivery_tag in self._recorded:
                self._recorded.discard(delivery_tag)
                from kombu.transport import virtual

                # The broker's record is made (the script): kombu's books only.
                virtual_append: Any = virtual.QoS.append
                return virtual_append(qos, message, delivery_tag)
            return append(message, delivery_tag)

        qos.append = append_unless_recorded

    def read(self, **options: Any) -> Any:
        self._answered.clear()
        delivered = self.read_one(**options)
        if delivered and self._answered:
            # Again while the list gave all that was asked: each call held raises the
            # window it is taken against (``window``), up to ``most`` in all.
            key, left = self._answered[-1], self.most
            while left > 0:
                asked, taken = self._take_more(key, left)
                left -= taken
                if not asked or taken < asked:
                    break
        return delivered

    def _room(self) -> int:
        if "can_consume" in vars(self.qos):
            # What the channel may take was narrowed beyond its window (Celery's
            # worker_disable_prefetch: no more requests than the pool runs), by a check
            # that answers for one message at a time: kombu's intake, which asks it.
            return 0
        prefetch = int(self.qos.prefetch_count or 0)
        if prefetch and self.window is not None:
            set_for_next_turn = int(self.window() or 0)
            prefetch = max(prefetch, set_for_next_turn) if set_for_next_turn else 0
        if not prefetch:
            return self.most
        return min(self.most, prefetch - len(self.qos._delivered))

    def _take_more(self, key: Any, most: int) -> tuple[int, int]:
        """Take up to the window's room (and ``most``) from ``key``: how many were
        asked for, and how many came."""
        room = min(self._room(), most)
        if room <= 0:
            return 0, 0
        from kombu.utils.encoding import bytes_to_str
        from kombu.utils.json import loads

        channel, qos = self.channel, self.qos
        # A connection error propagates as kombu's own read's does; the popped ones (if
        # the script ran) are recorded unacked: kombu restores them when this
        # connection's close or its visibility scan does.
        keys = internals.prefixed_keys(channel, [key, qos.unacked_index_key, qos.unacked_key])
        taken = self.script(
            keys=keys, args=[room, repr(time.time())], client=self.script_client or channel.client
        )
        queue = str(bytes_to_str(key)).rsplit(channel.sep, 1)[0]  # type: ignore[no-untyped-call]
        payloads = [_envelope(bytes_to_str(raw), loads) for raw in taken]  # type: ignore[no-untyped-call]
        tags = [payload["properties"]["delivery_tag"] for payload in payloads]
        self._recorded.update(tags)
        for i, payload in enumerate(payloads):
            try:
                channel.connection._deliver(payload, queue)
            except Exception:
                self._put_back(tags[i + 1 :])
                raise
        return room, len(payloads)

    def _put_back(self, tags: list[str]) -> None:
        """Messages taken but not handed over: back at the head of their list, in order
        (kombu's restore pushes each to the end its consumers pop from)."""
        for tag in reversed(tags):
            self._recorded.discard(tag)
            try:
                self.qos.restore_by_tag(tag)
            except Exception as exc:  # left in the unacked index: the visibility scan's
                logger.warning("baton: putting back message %s failed: %r", tag, exc)
