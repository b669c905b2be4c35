"""What the broker's transport means for the worker, read once from the app's settings.

kombu's Redis transport (``redis``, ``rediss``, ``sentinel``) and SQS keep a delivered
message unacknowledged for ``visibility_timeout`` and then deliver it again; AMQP
brokers give a message back when its channel closes. Redis also runs priority 0 first
(AMQP the highest first), and only its channel needs the help of ``broker_close`` (a
crash must not kill the worker) and ``held_return`` (held messages a crash left
behind).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("celery_baton.worker")

VISIBILITY_TRANSPORTS = ("redis", "rediss", "sqs", "sentinel")
REDIS_TRANSPORTS = ("redis", "rediss", "sentinel")


@dataclass(frozen=True)
class Broker:
    kombu_redis: bool
    #: Seconds an unacked message stays with its consumer (None: the broker gives it
    #: back when the channel closes, as AMQP does, or the setting is not a number).
    visibility: float | None
    #: Seconds within which such a message is delivered again: the timeout, once more
    #: for the copy's wait in the queue, kombu's Redis restore scan period, and its
    #: restore mutex's expiry (a worker killed or a broker stopped while a restore held
    #: it keeps every restore waiting that long).
    redelivery_window: float | None


def read_broker(app: Any) -> Broker:
    transport = app.connection_for_read().transport_cls
    scheme = transport.split("+")[0] if isinstance(transport, str) else None
    options = app.conf.broker_transport_options or {}
    visibility = window = None
    if scheme in VISIBILITY_TRANSPORTS:
        try:
            visibility = float(options.get("visibility_timeout", 3600))
            scan = restore_scan_period(options)
            mutex = float(options.get("unacked_mutex_expire", 300))
            window = 2 * visibility + max(0.0, scan) + max(0.0, mutex)
        except (TypeError, ValueError):
            pass
    return Broker(scheme in REDIS_TRANSPORTS, visibility, window)


def restore_scan_period(options: Any) -> float:
    """Seconds between the visibility scans of kombu's Redis transport (a worker's scan
    puts back the messages unacked for longer than the timeout): the transport options
    ``unacked_restore_interval`` x ``unacked_restore_throttle`` (10 x 10 by default).
    Before kombu 5.7 neither is a setting, and the scan runs every 10th call of a 10 s
    timer whatever the options say (kombu 5.3 ``transport/redis.py``:
    ``call_repeatedly(10, ...)``, ``restore_visible(interval=10)``): a window built on
    options asking 1 s came out 99 s short there."""
    interval = float(options.get("unacked_restore_interval", 10))
    throttle = float(options.get("unacked_restore_throttle", 10))
    try:
        from kombu.transport.redis import Channel
    except ImportError:  # redis-py missing: the options are all there is to go by
        return interval * throttle
    known = getattr(Channel, "from_transport_options", ())
    if "unacked_restore_interval" not in known or "unacked_restore_throttle" not in known:
        return 100.0
    return interval * throttle


def hold_horizon(configured: float, visibility: float | None) -> float:
    """How long a request may be held (``baton_hold_horizon``): less than half the
    broker's visibility timeout, so that a held message goes back to its queue well
    before the broker would deliver it again on its own."""
    return min(configured, visibility / 2) if visibility else configured


def warn_long_tasks(app: Any, visibility: float | None) -> None:
    """Warn about tasks that can outlive the broker's visibility timeout."""
    if visibility is None:
        return
    for name, task in sorted(app.tasks.items()):
        if name.startswith("celery."):
            continue
        expected = getattr(task, "expected_runtime", None)
        limit = task.time_limit or app.conf.task_time_limit
        longest = max(x for x in (expected, limit, 0) if x is not None)
        if longest > visibility:
            logger.warning(
                "task %s may run %ss, longer than the broker's visibility_timeout (%ss): "
                "its message would be redelivered to another worker while it runs. Raise "
                "broker_transport_options['visibility_timeout'] above %ss, and/or set "
                "baton_redelivery_guard = True so the copy never runs twice.",
                name,
                longest,
                visibility,
                longest,
            )


def warn_short_gaps(policies: Iterable[Any], redelivery_window: float | None) -> None:
    """Warn about ordered tasks whose gap bound is shorter than the broker's redelivery
    window: a killed worker's calls come back after their positions were skipped, and
    are refused (docs/guides/ordered.md, "Why 60 s")."""
    if redelivery_window is None:
        return
    for policy in policies:
        if policy is None or policy.ordered is None or policy.ordered_gap >= redelivery_window:
            continue
        logger.warning(
            "baton: %s is ordered with ordered_gap_timeout=%.0fs, shorter than the time the "
            "broker may take to deliver a killed worker's messages again (%.0fs: twice its "
            "visibility_timeout, its restore scan and its unacked_mutex_expire): such a call "
            "comes back after its position was skipped, and is refused. Lower those "
            "broker_transport_options or raise ordered_gap_timeout",
            policy.name,
            policy.ordered_gap,
            redelivery_window,
        )


def kombu_redis_qos(channel: Any, *, its_own_writes: bool = False) -> Any:
    """The channel's QoS when it is kombu's Redis transport's (None otherwise);
    ``its_own_writes``: and only if it still writes its records and acks as kombu's own
    does (a subclass that changed them keeps them)."""
    try:
        from kombu.transport.redis import QoS
    except ImportError:  # redis-py absent: not that transport
        return None
    qos = getattr(channel, "qos", None)
    if not isinstance(qos, QoS):
        return None
    kind = type(qos)
    if its_own_writes and (kind.append is not QoS.append or kind.ack is not QoS.ack):
        return None
    return qos
