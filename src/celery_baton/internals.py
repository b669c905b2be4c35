"""The private names of Celery and kombu that celery-baton uses, each looked up here.

Celery and kombu change what they do not document between minor versions, without
notice. Every private name celery-baton relies on is read through one function of this
module: it returns the thing when it is there and shaped as expected, and otherwise
None, after logging once per process what celery-baton does without it (the documented
behaviour, a little less well). ``tests/unit/test_internals.py`` asserts, on the Celery
and kombu installed, that each one is there; ``tests/matrix/run.py`` runs it on every
Celery minor celery-baton declares (docs/compatibility.md).

=====================================================  ================================
the name (kombu's Redis transport, Celery's worker)    without it
=====================================================  ================================
``redis.Channel.close`` + ``Channel._brpop_read``      a broker crash while a request
                                                       is held may stop the worker, as
                                                       in plain Celery
``redis.QoS._delivered`` + ``QoS.restore_by_tag``      held messages a broker crash
                                                       left unacked come back after the
                                                       visibility timeout
``Channel.conn_or_acquire`` +                          a held message goes back to its
``unacked_index_key``                                  queue at the hold horizon
                                                       instead of being kept
``Channel.unacked_key``, ``Channel.Message`` and      held messages a broker crash
kombu's virtual ``QoS.append``                         left unacked are put back in
                                                       their queues at the reconnect
                                                       instead of kept
``QoS._remove_from_indices``,                          a held message whose record
``Channel._do_restore_message``                        the broker refused or lost is
                                                       given back by kombu, which finds
                                                       nothing to give back (lost)
``Channel._lookup``, ``_q_for_pri``,                   a unique key whose ack failed is
``priority_steps``                                     kept for the redelivery window
``WorkController._process_task_sem`` and               pool slots counted against the
``_process_task``                                      pool's size (``CountedSlots``)
``AsynPool.on_job_ready``, ``on_process_alive``,       the worker is refused at start:
``_event_process_exit``, ``_all_inqueues``,            a request would be granted for
``_busy_workers``, ``outbound_buffer``,                a process that is leaving, and
``_fileno_to_inq``, ``_maxtasksperchild``;             a fresh rate token waited for
billiard's ``Worker._make_child_methods``              inside the time limits
Celery's gevent ``TaskPool._quick_put`` (set by        the worker is refused at start:
``on_start``, called by ``on_apply``)                  a rate grant or a throttle
                                                       window would not be judged at
                                                       the body's start
Celery's threads ``TaskPool.on_apply``'s               the worker is refused at start:
``accept_callback``                                    a rate grant or a throttle
                                                       window would not be judged at
                                                       the body's start
``Request._announce_revoked``                          a revoked admitted run is given
                                                       back from Celery's
                                                       ``task_revoked`` signal
``Request._announce_cancelled``                        a cancelled run's keys lapse
                                                       after ``lease_ttl``
``Request._context``                                   results stored with the request's
                                                       headers only
``crontab._orig_*``                                    the expanded fields (same times,
                                                       in numbers)
``Pool._cache`` (billiard's prefork pool)               on Celery before 5.6, a run
                                                       going on when the broker
                                                       connection was lost keeps its
                                                       keys for the worker's life
``kombu.Consumer._active_tags``                         where RabbitMQ keeps each
                                                       consumer's prefetch fixed,
                                                       held requests keep their slots
                                                       in it (one warning at start)
``celery.worker.control.Panel.data["revoke"]``         on Celery before 5.7, a replaced
                                                       run resolves to TaskRevokedError
                                                       once every worker handled the
                                                       revoke (a waiting caller still
                                                       gets TaskSuperseded)
``celery.worker.state.requests`` and                   a unique task revoked while it
``active_requests``                                    waits for its countdown frees
                                                       its key when it is discarded
                                                       (REVOKED stored before, on
                                                       Celery 5.6 and later)
``celery.bin.celery.find_app`` (the name the ``celery``  a bad task option prints Celery's
command loads ``-A`` with)                              import traceback, its line last
``Celery._tasks``, ``Celery._pending`` and a            tasks declared before
pending ``PromiseProxy``'s ``_Proxy__args`` /           ``Baton(app)`` are checked at
``_Proxy__kwargs``                                     worker start, not when it is made
``Backend._get_result_meta`` (the record               a batch's results on a Redis
``_store_result`` writes) and                          result backend are written one
``RedisBackend._MAX_STR_VALUE_SIZE``                   by one (two round trips each)
``kombu.utils.functional.sleep``,                      on gevent and eventlet, a
``celery.worker.consumer.consumer.sleep`` (each          broker reconnect may stop every
module's own ``from time import sleep``)                greenlet while it waits
=====================================================  ================================
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from collections.abc import Set as AbstractSet
from typing import Any

logger = logging.getLogger("celery_baton")

_reported: set[str] = set()
_lock = threading.Lock()


def unavailable(name: str, without: str) -> None:
    """Log, once per process, that the private ``name`` is not there and what is done."""
    with _lock:
        if name in _reported:
            return
        _reported.add(name)
    logger.warning(
        "baton: %s is not in this Celery/kombu (%s): %s. celery-baton is tested on the "
        "versions listed in docs/compatibility.md",
        name,
        _installed(),
        without,
    )


def _installed() -> str:
    try:
        import celery
        import kombu

        return f"celery {celery.__version__}, kombu {kombu.__version__}"
    except ImportError:  # pragma: no cover
        return "versions unknown"


# -- kombu's Redis transport ----------------------------------------------------------


def redis_channel_close(channel_class: type) -> Callable[[Any], None] | None:
    """kombu's Redis ``Channel.close`` as defined on the class, when the channel reads a
    pending BRPOP in it (``_brpop_read``): the close ``broker_close`` completes."""
    close = channel_class.__dict__.get("close")
    if callable(close) and callable(getattr(channel_class, "_brpop_read", None)):
        return close  # type: ignore[no-any-return]
    unavailable(
        "kombu.transport.redis.Channel.close/_brpop_read",
        "a broker crash while a request is held may stop the worker, as in plain Celery",
    )
    return None


def unrestored(channel: Any) -> Any:
    """The delivered, unacknowledged messages a channel's QoS still holds by delivery tag
    (``QoS._delivered``; None when not there): what its close could not restore."""
    delivered = getattr(getattr(channel, "qos", None), "_delivered", None)
    if isinstance(delivered, Mapping) and callable(getattr(delivered, "pop", None)):
        return delivered
    if channel is not None:
        unavailable(
            "kombu's QoS._delivered",
            "held messages a broker crash left unacked come back after the visibility timeout",
        )
    return None


def restore_by_tag(channel: Any) -> Callable[[str], Any] | None:
    """The channel's ``QoS.restore_by_tag`` (moves an unacked message back to its queue
    in one transaction, if it is still unacked)."""
    restore = getattr(getattr(channel, "qos", None), "restore_by_tag", None)
    if callable(restore):
        return restore  # type: ignore[no-any-return]
    if channel is not None:
        unavailable(
            "kombu's QoS.restore_by_tag",
            "held messages a broker crash left unacked come back after the visibility timeout",
        )
    return None


def restore_with_record(qos: Any) -> Callable[[str, str, bool], None] | None:
    """A function that puts a delivered message back in its queue in one transaction, as
    kombu's Redis ``QoS.restore_by_tag`` does, from the broker's record of it or, where
    the broker has none (its record was refused, or lost with a connection), from
    ``record``: the record as kombu writes it (JSON of payload, exchange, routing key),
    which only the worker that received the message still has."""
    from kombu.utils.encoding import bytes_to_str
    from kombu.utils.json import loads

    channel = getattr(qos, "channel", None)
    remove = getattr(qos, "_remove_from_indices", None)
    put = getattr(channel, "_do_restore_message", None)
    acquire = getattr(channel, "conn_or_acquire", None)
    unacked = getattr(qos, "unacked_key", None)
    if not (callable(remove) and callable(put) and callable(acquire)) or not isinstance(
        unacked, str
    ):
        unavailable(
            "kombu's Redis QoS._remove_from_indices/unacked_key, "
            "Channel._do_restore_message/conn_or_acquire",
            "a held message whose record the broker refused is given back by kombu, "
            "which finds nothing to give back",
        )
        return None

    def restore(tag: str, record: str, leftmost: bool = False) -> None:
        def transaction(pipe: Any) -> None:
            stored = pipe.hget(unacked, tag)
            pipe.multi()
            remove(tag, pipe)
            payload, exchange, routing_key = loads(bytes_to_str(stored or record))  # type: ignore[no-untyped-call]
            put(payload, exchange, routing_key, pipe, leftmost)

        with acquire() as client:
            client.transaction(transaction, unacked)

    return restore


def restamp_unacked(channel: Any) -> Callable[[list[str], float], list[bool]] | None:
    """A function that renews, in one round trip, the delivery time of unacked messages
    in kombu's Redis unacked index (the score its visibility scan compares with the
    timeout), for those still there; it says which were."""
    acquire = getattr(channel, "conn_or_acquire", None)
    index = getattr(channel, "unacked_index_key", None)
    if not callable(acquire) or not isinstance(index, str):
        unavailable(
            "kombu's Redis Channel.conn_or_acquire/unacked_index_key",
            "a held message goes back to its queue at the hold horizon",
        )
        return None

    def restamp(tags: list[str], now: float) -> list[bool]:
        with acquire() as client:
            pipe = client.pipeline(transaction=False)
            for tag in tags:
                # XX: never adds one that is gone (acked, or restored by a scan);
                # CH: counts the ones whose score changed, i.e. that were there.
                pipe.zadd(index, {tag: now}, xx=True, ch=True)
            return [bool(changed) for changed in pipe.execute()]

    return restamp


def adopt_unacked(channel: Any) -> Callable[[str, float], Any] | None:
    """A function that takes a message still in kombu's Redis unacked index into
    ``channel``, as if the channel had just delivered it, without it leaving the index:
    its delivery time written anew (checked and written in one transaction) and the
    message in the channel's delivered set, acked or restored through it from then on.
    It returns the kombu message, or None when the message is no longer unacked."""
    from kombu.transport import virtual
    from kombu.utils.encoding import bytes_to_str
    from kombu.utils.json import loads

    qos = getattr(channel, "qos", None)
    acquire = getattr(channel, "conn_or_acquire", None)
    unacked = getattr(channel, "unacked_key", None)
    index = getattr(channel, "unacked_index_key", None)
    message_class = getattr(channel, "Message", None)
    if not (
        isinstance(qos, virtual.QoS)
        and callable(acquire)
        and isinstance(unacked, str)
        and isinstance(index, str)
        and callable(message_class)
    ):
        if channel is not None:
            unavailable(
                "kombu's Redis Channel.unacked_key/Message and QoS.append",
                "held messages a broker crash left unacked are put back in their queues",
            )
        return None

    def adopt(tag: str, now: float) -> Any:
        def claim(pipe: Any) -> Any:
            raw = pipe.hget(unacked, tag)
            pipe.multi()
            if raw is not None:
                pipe.zadd(index, {tag: now})
            return raw

        with acquire() as client:
            raw = client.transaction(claim, unacked, value_from_callable=True)
        if raw is None:
            return None
        payload = loads(bytes_to_str(raw))[0]  # type: ignore[no-untyped-call]
        message = message_class(payload, channel=channel)
        # The channel's delivered set only (the Redis QoS's own append writes again).
        virtual.QoS.append(qos, message, tag)  # type: ignore[no-untyped-call]
        return message

    return adopt


def _per_priority(channel: Any) -> Callable[[Iterable[str]], list[str]] | None:
    """The Redis lists that hold the messages of some queues, one per priority step
    (``_q_for_pri``, ``priority_steps``); None where this kombu has neither."""
    q_for_pri = getattr(channel, "_q_for_pri", None)
    steps = getattr(channel, "priority_steps", None)
    if not callable(q_for_pri) or steps is None:
        return None
    return lambda queues: list(dict.fromkeys(q_for_pri(q, pri) for q in queues for pri in steps))


def key_prefix(channel: Any) -> str:
    """kombu's ``global_keyprefix`` of a Redis channel ('' : none): its client puts it
    before the keys of the commands it knows (not ``EVAL``'s, and only the first of an
    ``EVALSHA``'s), so a script run on the broker is given every key with it."""
    return str(getattr(channel, "global_keyprefix", "") or "")


def prefixed_keys(channel: Any, keys: Iterable[str | bytes]) -> list[str]:
    """``keys`` as the broker names them: each with :func:`key_prefix` before it (a
    key kombu read back, in bytes, as text)."""
    prefix = key_prefix(channel)
    return [prefix + (key.decode() if isinstance(key, bytes) else key) for key in keys]


def priority_lists(channel: Any, queues: Iterable[str]) -> list[str] | None:
    """The Redis lists that hold the messages of the queues named ``queues``."""
    per_priority = _per_priority(channel)
    if per_priority is not None:
        return per_priority(queues)
    unavailable(
        "kombu's Channel._q_for_pri/priority_steps",
        "`baton cancel` does not say whether the call is queued",
    )
    return None


def queue_lists(channel: Any, exchange: Any, routing_key: Any) -> list[str] | None:
    """The Redis lists a message sent to ``exchange`` with ``routing_key`` is restored to
    (every priority of every queue bound; ``_lookup``, ``_q_for_pri``)."""
    lookup = getattr(channel, "_lookup", None)
    per_priority = _per_priority(channel)
    if callable(lookup) and per_priority is not None:
        return per_priority(lookup(exchange, routing_key))
    unavailable(
        "kombu's Channel._lookup/_q_for_pri/priority_steps",
        "a unique key whose ack failed is kept for the redelivery window",
    )
    return None


# -- kombu's consumers ----------------------------------------------------------------


def consumer_tags(task_consumer: Any) -> frozenset[str] | None:
    """The tags of a kombu ``Consumer``'s consumers now (``_active_tags``: queue name ->
    tag), which the broker names in each delivery."""
    tags = getattr(task_consumer, "_active_tags", None)
    if isinstance(tags, Mapping) and all(isinstance(tag, str) for tag in tags.values()):
        return frozenset(tags.values())
    unavailable(
        "kombu's Consumer._active_tags",
        "where RabbitMQ keeps each consumer's prefetch fixed, held requests keep their slots in it",
    )
    return None


# -- Celery's worker ------------------------------------------------------------------


def task_qos_global(consumer: Any) -> bool | None:
    """Whether the prefetch count Celery raises for ETA (and held) requests is one for
    the task channel (True), per consumer on an AMQP broker (False: RabbitMQ applies a
    new count only to consumers created after it), or None (not AMQP: kombu's virtual
    transports count on the channel)."""
    connection: Any = getattr(consumer, "connection", None)
    if getattr(getattr(connection, "transport", None), "driver_type", None) != "amqp":
        return None
    recorded = getattr(consumer, "qos_global", None)  # Celery 5.7 records what it chose
    if isinstance(recorded, bool):
        return recorded
    # Before 5.7: Tasks.start's own choice, from the same public parts.
    if connection.qos_semantics_matches_spec:
        return False
    app = consumer.app
    try:
        from celery.utils.quorum_queues import detect_quorum_queues
    except ImportError:  # before Celery 5.5: global QoS, also on quorum queues
        return True
    if app.conf.get("worker_detect_quorum_queues", True):
        quorum, _ = detect_quorum_queues(app, "amqp")
        if quorum:
            return False
    return True


def semaphore_process_task(controller: Any, handle: Any) -> Callable[[Any], Any] | None:
    """``WorkController._process_task`` when Celery hands requests to the pool through
    its semaphore (``handle`` is ``_process_task_sem``); None otherwise."""
    semaphore = getattr(controller, "semaphore", None)
    if semaphore is None:  # no semaphore: not prefork on the event loop
        return None
    through_semaphore = getattr(controller, "_process_task_sem", None)
    process_task = getattr(controller, "_process_task", None)
    if through_semaphore is None or not callable(process_task):
        unavailable(
            "celery's WorkController._process_task_sem/_process_task",
            "pool slots are counted against the pool's size instead of its semaphore",
        )
        return None
    return process_task if handle == through_semaphore else None


#: What ``worker/pool/prefork.py`` overrides or reads of Celery's event-loop prefork pool
#: (``AsynPool``) and billiard's pool process (``Worker``), on the class or set by
#: ``__init__``.
ASYNPOOL_NAMES = (
    "on_job_ready",
    "on_process_alive",
    "_event_process_exit",
    "register_with_event_loop",
    "maintain_pool",
    "_all_inqueues",
    "_busy_workers",
    "outbound_buffer",
    "_fileno_to_inq",
    "flush",
    "apply_async",
    "_state",
)
POOL_NAMES = ("_maxtasksperchild", "_pool")
WORKER_NAMES = ("_make_child_methods", "wait_for_job")


def _names_of(cls: type, names: tuple[str, ...]) -> list[str]:
    """The ``names`` that ``cls`` lacks, as a method or an attribute its ``__init__``
    (or a method of its bases) sets."""
    import inspect

    try:
        source = "".join(inspect.getsource(klass) for klass in cls.__mro__[:-1])
    except (OSError, TypeError):
        source = ""
    return [name for name in names if not hasattr(cls, name) and f"self.{name}" not in source]


def prefork_pool_classes(task_pool: Any) -> tuple[type, type] | None:
    """Celery's event-loop prefork pool and billiard's blocking one, when ``task_pool``
    (Celery's prefork ``TaskPool``) starts exactly those and they are shaped as
    ``worker/pool/prefork.py`` expects; None otherwise (logged once)."""
    from billiard import pool as billiard_pool
    from celery.concurrency import asynpool

    asyn, blocking = getattr(task_pool, "Pool", None), getattr(task_pool, "BlockingPool", None)
    if asyn is not asynpool.AsynPool or blocking is not billiard_pool.Pool:
        return None  # a pool class of its own: not one celery-baton knows
    missing = (
        _names_of(asyn, ASYNPOOL_NAMES + POOL_NAMES)
        + _names_of(blocking, POOL_NAMES)
        + _names_of(asynpool.Worker, WORKER_NAMES)
        + _names_of(billiard_pool.Worker, WORKER_NAMES)
    )
    if missing:
        unavailable(
            f"celery's AsynPool / billiard's Worker {', '.join(missing)}",
            "the worker is refused at start",
        )
        return None
    return asyn, blocking


#: Celery's gevent and eventlet pools, as ``worker/pool/in_process.py`` extends them:
#: ``on_start`` sets ``_quick_put`` (the pool's ``spawn``), which ``on_apply`` calls with
#: ``(apply_timeout or apply_target, target, args, kwargs, callback, accept_callback,
#: getpid, ...)`` (gevent: ``timeout=..., timeout_callback=...`` too).
GEVENT_POOL_NAMES = ("on_start", "on_apply", "_quick_put")


def gevent_pool(task_pool: Any) -> bool | None:
    """True when ``task_pool`` is Celery's gevent ``TaskPool`` shaped as
    ``worker/pool/in_process.py`` expects; None when it is another pool; False when it
    is Celery's gevent pool without those names (logged once)."""
    return _green_pool(task_pool, "gevent")


def eventlet_pool(task_pool: Any) -> bool | None:
    """The same for Celery's eventlet ``TaskPool``."""
    return _green_pool(task_pool, "eventlet")


def _green_pool(task_pool: Any, name: str) -> bool | None:
    cls = type(task_pool)
    if cls.__module__ != f"celery.concurrency.{name}" or cls.__name__ != "TaskPool":
        return None
    missing = _names_of(cls, GEVENT_POOL_NAMES)
    if missing:
        unavailable(
            f"celery's {name} TaskPool {', '.join(missing)}", "the worker is refused at start"
        )
        return False
    return True


def threads_pool(task_pool: Any) -> bool | None:
    """True when ``task_pool`` is Celery's threads ``TaskPool`` and its ``on_apply``
    takes the ``accept_callback`` it calls on the executor thread before the body
    (``worker/pool/in_process.py``); None when it is another pool; False when it is
    Celery's threads pool without it (logged once)."""
    import inspect

    cls = type(task_pool)
    if cls.__module__ != "celery.concurrency.thread" or cls.__name__ != "TaskPool":
        return None
    on_apply = getattr(cls, "on_apply", None)
    if on_apply is None or "accept_callback" not in inspect.signature(on_apply).parameters:
        unavailable(
            "celery's threads TaskPool.on_apply(accept_callback)", "the worker is refused at start"
        )
        return False
    return True


def pool_job_cache(task_pool: Any) -> dict[Any, Any] | None:
    """The prefork pool's jobs by id (billiard's ``Pool._cache``; an entry has
    ``_accepted`` once its process took it), when ``task_pool`` has one and a ``flush``
    that Celery calls when the broker connection is lost; None otherwise."""
    cache = getattr(getattr(task_pool, "_pool", None), "_cache", None)
    if not callable(getattr(task_pool, "flush", None)):
        return None  # not a pool that Celery flushes (threads, solo, ...)
    if isinstance(cache, dict):
        return cache
    unavailable(
        "billiard's Pool._cache",
        "on Celery before 5.6, a run that was going on when the broker connection was "
        "lost keeps its exclusive keys and concurrency slots for the worker's life",
    )
    return None


def control_panel() -> dict[str, Any] | None:
    """The worker's remote-control handlers by name (``Panel.data``: the dict the
    worker's mailbox dispatches from), when its ``revoke`` handler is there."""
    from celery.worker import control

    panel = getattr(getattr(control, "Panel", None), "data", None)
    if isinstance(panel, dict) and callable(panel.get("revoke")):
        return panel
    unavailable(
        "celery's worker control Panel.data['revoke']",
        "on Celery before 5.7 a replaced run resolves to TaskRevokedError once every "
        "worker handled the revoke",
    )
    return None


def worker_requests() -> tuple[Mapping[str, Any], AbstractSet[Any]] | None:
    """The worker's requests by task id (reserved, scheduled for an ETA, running) and the
    set of those a pool process accepted (``celery.worker.state``)."""
    from celery.worker import state

    requests = getattr(state, "requests", None)
    active = getattr(state, "active_requests", None)
    if isinstance(requests, Mapping) and isinstance(active, AbstractSet):
        return requests, active
    unavailable(
        "celery's worker state requests and active_requests",
        "a unique task revoked while it waits for its countdown frees its key when it is discarded",
    )
    return None


#: Celery's Request methods every terminal path of a revoke or cancel goes through.
REQUEST_HOOKS = ("_announce_revoked", "_announce_cancelled")


def missing_request_hooks(request_class: type) -> list[str]:
    """The :data:`REQUEST_HOOKS` ``request_class`` lacks (each logged once)."""
    missing = [name for name in REQUEST_HOOKS if not callable(getattr(request_class, name, None))]
    for name in missing:
        unavailable(
            f"celery's Request.{name}",
            "a revoked admitted run is given back from the task_revoked signal"
            if name == "_announce_revoked"
            else "a cancelled run's keys lapse after its lease_ttl",
        )
    return missing


def request_context(request: Any) -> Any:
    """The request's task context for the result backend (``Request._context``);
    without it, one built from its headers (no embedded callbacks)."""
    try:
        return request._context
    except AttributeError:
        pass
    unavailable("celery's Request._context", "results are stored with the request's headers")
    from celery.app.task import Context

    return Context(dict(getattr(request, "request_dict", None) or {}))


# -- Celery's result backends ----------------------------------------------------------

#: The methods by which Celery's Redis result backend writes a task's record: a subclass
#: that overrides one writes something else, and its records are written its own way.
REDIS_RECORD_PATH = (
    "mark_as_done",
    "mark_as_failure",
    "store_result",
    "_store_result",
    "_get_result_meta",
    "_set_with_state",
    "set",
    "_set",
    "encode",
    "encode_result",
    "get_key_for_task",
    "_get_task_meta_for",
)


def redis_record_writer(backend: Any) -> tuple[Callable[..., dict[str, Any]], int] | None:
    """When ``backend`` is Celery's Redis result backend (or a subclass writing records
    as it does): the function that makes a task's record as ``_store_result`` writes it
    (``_get_result_meta(result=, state=, traceback=, request=)``) and the longest value
    it stores; otherwise None (and, when Celery's names are missing, logged once)."""
    try:
        from celery.backends.redis import RedisBackend
    except ImportError:  # no redis-py: no Redis result backend either
        return None
    if not isinstance(backend, RedisBackend):
        return None
    if any(
        getattr(type(backend), name, None) is not getattr(RedisBackend, name, None)
        for name in REDIS_RECORD_PATH
    ):
        return None
    make = getattr(backend, "_get_result_meta", None)
    longest = getattr(RedisBackend, "_MAX_STR_VALUE_SIZE", None)
    if not callable(make) or not isinstance(longest, int):
        unavailable(
            "celery's Backend._get_result_meta and RedisBackend._MAX_STR_VALUE_SIZE",
            "a batch's results are written one by one",
        )
        return None
    return make, longest


# -- Celery's schedules -----------------------------------------------------------------

CRONTAB_FIELDS = ("minute", "hour", "day_of_week", "day_of_month", "month_of_year")


def crontab_fields(schedule: Any) -> dict[str, Any]:
    """A crontab's fields as it was given them (``_orig_minute``...), else the sets it
    expanded them to (the same times)."""
    given = {name: getattr(schedule, f"_orig_{name}", None) for name in CRONTAB_FIELDS}
    if all(value is not None for value in given.values()):
        return given
    unavailable("celery's crontab._orig_* fields", "the expanded fields are stored")
    return {
        name: ",".join(str(n) for n in sorted(getattr(schedule, name))) for name in CRONTAB_FIELDS
    }


# -- Celery's app: the tasks declared so far ---------------------------------------------


def declared_tasks(app: Any) -> tuple[list[Any], list[tuple[Any, dict[str, Any]]]] | None:
    """The tasks ``app`` has so far, without finalizing it (``Baton(app)`` must not:
    tasks still to be declared, and ``autofinalize=False``): the registered task
    objects (``Celery._tasks``), and ``(function, options)`` of each ``@app.task`` not
    evaluated yet (the ``PromiseProxy`` in ``Celery._pending`` keeps them as
    ``_Proxy__args`` / ``_Proxy__kwargs`` until it is)."""
    registered = getattr(app, "_tasks", None)
    pending = getattr(app, "_pending", None)
    if registered is None or pending is None:
        unavailable(
            "celery's Celery._tasks/_pending",
            "tasks declared before Baton(app) are checked at worker start",
        )
        return None
    declarations = []
    for proxy in list(pending):
        try:
            args = object.__getattribute__(proxy, "_Proxy__args")
            options = object.__getattribute__(proxy, "_Proxy__kwargs")
        except AttributeError:
            continue  # evaluated: it is among the registered tasks
        if args and callable(args[0]) and isinstance(options, dict):
            declarations.append((args[0], dict(options)))
    return list(dict(registered).values()), declarations


def cli_app_loader() -> Any:
    """The module of the ``celery`` command while it is being set up (it loads its
    ``celery.commands`` entry points, ``baton`` among them, before it loads ``-A``),
    when it loads the app through its global ``find_app``; None otherwise."""
    import sys

    module = sys.modules.get("celery.bin.celery")
    if module is None:
        return None  # not the celery command: nothing to do
    if callable(getattr(module, "find_app", None)):
        return module
    unavailable(
        "celery.bin.celery.find_app",
        "a bad task option prints Celery's import traceback, its own line last",
    )
    return None


#: The modules whose own ``sleep`` (``from time import sleep``, bound at their import)
#: the worker's broker reconnect waits with: kombu's ``retry_over_time`` and Celery's
#: consumer.
RECONNECT_SLEEPERS = ("kombu.utils.functional", "celery.worker.consumer.consumer")


def reconnect_sleepers() -> list[Any]:
    """The modules of :data:`RECONNECT_SLEEPERS` that hold a ``sleep`` of their own."""
    import importlib

    found = []
    for name in RECONNECT_SLEEPERS:
        module = importlib.import_module(name)
        if callable(getattr(module, "sleep", None)):
            found.append(module)
        else:
            unavailable(
                f"{name}.sleep",
                "on gevent and eventlet, a broker reconnect may stop every greenlet while "
                "it waits, as in plain Celery",
            )
    return found
