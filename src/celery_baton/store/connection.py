"""Store URL -> client, and the embedded Valkey server used when no URL is given.

URL forms:

* ``redis://[:password@]host:port/db``, ``rediss://...`` (TLS), ``unix:///path.sock?db=0``
* ``sentinel://[:password@]host:port[,host:port...]/service_name[/db]``
* ``redis+cluster://host:port`` (Redis Cluster; every script's keys share one hash tag)
* ``embedded://`` (or no URL at all): a Valkey server on a unix socket in a per-user
  runtime directory, started once under a file lock and shared by every process of
  this user on this machine (embedded.py).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit, urlunsplit

import redis
import redis.cluster
import redis.sentinel

from celery_baton.errors import ConfigError, StoreUnavailable
from celery_baton.store.embedded import (
    SOCKET,
    EmbeddedConnection,
    answers,
    ensure_embedded_server,
    runtime_dir,
    stop_embedded_server,
)
from celery_baton.store.scripts import Scripts
from celery_baton.store.shards import ShardMasters

EMBEDDED_URL = "embedded://"

logger = logging.getLogger("celery_baton.store")

#: How often a Sentinel store asks the sentinels which node is the master (seconds).
MASTER_CHECK_INTERVAL = 0.5
#: Sentinel's own default ``down-after-milliseconds``, in seconds.
DEFAULT_DOWN_AFTER = 30.0

#: What a client error looks like when the store is down or slow.
STORE_ERRORS: tuple[type[BaseException], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError,
    redis.exceptions.BusyLoadingError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.MasterDownError,
    # Not Redis at that address (a broker's AMQP port, an HTTP server): no store answers
    # there, and a worker that let it escape died ("Unrecoverable error").
    redis.exceptions.InvalidResponse,
    ConnectionError,
    OSError,
)
#: What creating a cluster client raises when no node it was given answers.
CLUSTER_UNREACHABLE: tuple[type[BaseException], ...] = (
    redis.exceptions.RedisClusterException,
    *STORE_ERRORS,
)


def redact_url(url: str) -> str:
    """The URL with any password replaced by ``***``: safe for logs and the CLI."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def _where(url: str) -> str:
    """``host:port`` (or the socket's path) of a store URL, for an operator."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return parts.path
    host = parts.netloc.rsplit("@", 1)[-1]
    return host if ":" in host.rsplit("]", 1)[-1] else f"{host}:6379"


#: What the resolver says of a host it cannot find (glibc, musl, macOS), in redis-py's text.
_UNKNOWN_HOST = ("Name or service not known", "nodename nor servname", "Name does not resolve")


def _caused_by(exc: BaseException, kind: type[BaseException], words: tuple[str, ...]) -> bool:
    seen: BaseException | None = exc
    for _ in range(4):  # the client's error, and the socket's under it
        if seen is None:
            return False
        if isinstance(seen, kind) or any(w in str(seen) for w in words):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


#: What the first byte of a reply that is not Redis's says of the server that sent it
#: (redis-py: 'Protocol error, got "A" as reply type byte').
_NOT_REDIS_HINTS = {"A": " (is it the broker's AMQP port?)", "H": " (is it an HTTP server?)"}


def failure_in_words(exc: BaseException, url: str) -> str:
    """What a failed store call means, for an operator: the client's own repr says
    ``network:ConnectionError`` (redis-py 8), which names neither where nor what."""
    if isinstance(exc, redis.sentinel.MasterNotFoundError):
        # First: its text is every sentinel client's repr (~1,000 characters), and may
        # hold any of the words looked for below.
        return _no_master_in_words(exc, url)
    if isinstance(exc, redis.exceptions.InvalidResponse):
        byte = str(exc).partition('got "')[2][:1]
        return (
            f"{_where(url)} does not speak the Redis protocol"
            f"{_NOT_REDIS_HINTS.get(byte, '')}: check baton_url"
        )
    if _caused_by(exc, ConnectionRefusedError, ("Connection refused",)):
        return f"connection refused at {_where(url)}: is the store running there? check baton_url"
    if _caused_by(exc, socket.gaierror, _UNKNOWN_HOST):
        return f"unknown host in {_where(url)} (its name does not resolve here): check baton_url"
    if isinstance(exc, redis.TimeoutError | TimeoutError):
        return f"no answer from {_where(url)} within the socket timeout (baton_socket_timeout)"
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _no_master_in_words(exc: BaseException, url: str) -> str:
    parts = urlsplit(url)
    sentinels = ",".join(
        node if ":" in node else f"{node}:26379"
        for node in parts.netloc.rsplit("@", 1)[-1].split(",")
    )
    service = next((p for p in parts.path.split("/") if p), "")
    # redis-py appends each sentinel's error to the text; without any, they all answered.
    if " : " in str(exc):
        return (
            f"no sentinel answered at {sentinels} (or none knows the master {service!r}): "
            "check baton_url"
        )
    return (
        f"the sentinels at {sentinels} name no working master {service!r} (a failover under "
        "way, or no such master): check baton_url"
    )


#: Every store client of this process, for a forked child to make its connection pools
#: usable (``_fresh_pool_locks``).
_STORE_CLIENTS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


def _pools_of(client: Any) -> list[Any]:
    """The connection pools of a store client (a cluster's, one per node it knows)."""
    pool = getattr(client, "connection_pool", None)
    if pool is not None:
        return [pool]
    nodes = getattr(client, "get_nodes", None)
    found = []
    for node in nodes() if callable(nodes) else ():
        node_client = getattr(node, "redis_connection", None)
        if node_client is not None:
            found.append(node_client.connection_pool)
    return found


def _fresh_pool_locks() -> None:
    """In a forked child (a pool process Celery forks from the worker's main process:
    ``--max-tasks-per-child``, ``--autoscale``, a replacement), before it uses a store.

    redis-py's ConnectionPool sees the fork at the child's first call and resets itself,
    taking the pool's lock (redis-py 8 does so to count the connections it drops). The
    child inherits that lock as it was at the fork: held by another thread of the main
    process at that instant (celery-baton's lease renewer, its notice listener), it is
    never released in the child, which hung for ever at its first store call, its run's
    lease and concurrency slot held (tests/store/test_fork.py; a recycled pool under
    ``global_concurrency`` stalled). The child has one thread: fresh locks are safe."""
    for client in list(_STORE_CLIENTS.values()):
        try:
            pools = _pools_of(client)
        except Exception:  # never break a fork over a client that cannot say
            continue
        for pool in pools:
            for name in ("_lock", "_fork_lock"):
                old = getattr(pool, name, None)
                if old is None:
                    continue
                reentrant = isinstance(old, type(threading.RLock()))
                setattr(pool, name, threading.RLock() if reentrant else threading.Lock())


os.register_at_fork(after_in_child=_fresh_pool_locks)


@dataclass
class Store:
    """A connected store: the client, its scripts, and where it is."""

    url: str
    client: Any  # redis.Redis | redis.cluster.RedisCluster
    embedded: bool = False
    #: Sentinel only: counts master changes (see :class:`MasterWatch`).
    master_watch: MasterWatch | None = None
    #: Seconds a call waits for its answer before it fails (None: for ever).
    socket_timeout: float | None = None
    #: Redis Cluster only: who serves which slot (see :class:`ShardMasters`).
    shards: ShardMasters | None = None
    scripts: Scripts = field(init=False)

    def __post_init__(self) -> None:
        generation = self.master_watch.generation if self.master_watch else None
        self.scripts = Scripts(self.client, generation=generation)
        _STORE_CLIENTS[id(self.client)] = self.client

    @property
    def cluster(self) -> bool:
        """A Redis Cluster: a script's keys must share one slot, and there is no single
        connection to pipeline on (the one place that tells; nothing else duck-types)."""
        return not hasattr(self.client, "connection_pool")

    @property
    def safe_url(self) -> str:
        return redact_url(self.url)

    def unavailable(self, exc: BaseException) -> StoreUnavailable:
        """The error to raise ``from exc`` when a client call failed."""
        return StoreUnavailable(
            f"store call failed: {failure_in_words(exc, self.url)}", url=self.safe_url
        )

    def ping(self) -> float:
        """Round-trip time of one PING, in seconds."""
        start = time.perf_counter()
        try:
            self.client.ping()
        except STORE_ERRORS as exc:
            raise self.unavailable(exc) from exc
        return time.perf_counter() - start


def connect(
    url: str | None = None,
    *,
    socket_timeout: float = 2.0,
    client_name: str | None = None,
    start_embedded: bool = True,
) -> Store:
    """Connect to the store at ``url``; ``None`` or ``embedded://`` starts the embedded one
    (unless ``start_embedded`` is False: an operator's look must not start a server).

    >>> store = connect("redis://127.0.0.1:6379/0")  # doctest: +SKIP
    """
    if not url or url.startswith("embedded:"):
        sock = runtime_dir() / SOCKET
        if not start_embedded and not answers(sock):
            raise StoreUnavailable(
                "no store URL is set (baton_url / $BATON_URL) and no embedded store runs "
                "on this machine: nothing to look at",
                url=EMBEDDED_URL,
            )
        if start_embedded:
            sock = ensure_embedded_server()
        url = f"unix://{sock}"
        # A process that uses the embedded store starts it again when it finds it gone;
        # an operator's look never starts one.
        restart = EmbeddedConnection if start_embedded else None
        local = _redis_from_url(url, socket_timeout, client_name, connection_class=restart)
        return Store(url, local, embedded=True, socket_timeout=socket_timeout)
    scheme = urlsplit(url).scheme
    if scheme in ("redis", "rediss", "unix"):
        plain_client = _redis_from_url(url, socket_timeout, client_name)
        _check_database(plain_client, url)
        return Store(url, plain_client, socket_timeout=socket_timeout)
    if scheme in ("sentinel", "sentinels"):
        master = _sentinel_client(url, socket_timeout, client_name)
        _check_database(master, url)
        watch = MasterWatch(master.connection_pool)
        return Store(url, master, master_watch=watch, socket_timeout=socket_timeout)
    if scheme in ("redis+cluster", "rediss+cluster"):
        plain = url.replace("+cluster", "", 1)
        try:
            # Reads the cluster's layout now: fails when no node named answers.
            client = redis.cluster.RedisCluster.from_url(
                plain,
                socket_timeout=socket_timeout,
                socket_connect_timeout=socket_timeout,
                decode_responses=True,
            )
        except CLUSTER_UNREACHABLE as exc:
            raise StoreUnavailable(f"cannot reach the cluster: {exc}", url=redact_url(url)) from exc
        return Store(url, client, socket_timeout=socket_timeout, shards=ShardMasters(client))
    raise ConfigError(
        "unsupported store URL scheme; use redis://, rediss://, unix://, sentinel://, "
        "redis+cluster:// or embedded://",
        subject=redact_url(url),
    )


def _check_database(client: redis.Redis, url: str) -> None:
    """Refuse a database number the server does not have (``redis://host/99`` on a
    server with 16): every command would fail with "DB index is out of range", which the
    worker would take for a store that is down and hold its tasks forever. Only a
    non-zero database is asked about (database 0 always exists), and a store that does
    not answer now is left to the store-down policy: that is not a wrong URL."""
    db = int(client.connection_pool.connection_kwargs.get("db") or 0)
    if db == 0:
        return
    try:
        client.ping()
    except redis.ResponseError as exc:
        if "DB index" not in str(exc):
            raise
        raise ConfigError(
            f"{redact_url(url)!r}: the store has no database {db} ({exc}); "
            "use a database number below its `databases` setting (16 by default)",
            subject="baton_url",
        ) from exc
    except STORE_ERRORS:
        pass


def _redis_from_url(
    url: str, socket_timeout: float, client_name: str | None, connection_class: Any = None
) -> redis.Redis:
    extra = {"connection_class": connection_class} if connection_class else {}
    return redis.Redis.from_url(
        url,
        socket_timeout=socket_timeout,
        socket_connect_timeout=socket_timeout,
        health_check_interval=30,
        decode_responses=True,
        client_name=client_name,
        **extra,
    )


def _sentinel_client(url: str, socket_timeout: float, client_name: str | None) -> redis.Redis:
    """``sentinel://[:pw@]h1:p1,h2:p2/service[/db]``: the master of ``service``."""
    parts = urlsplit(url)
    hostlist = parts.netloc.rsplit("@", 1)[-1]
    nodes: list[tuple[str, int]] = []
    for node in hostlist.split(","):
        host, _, port = node.partition(":")
        nodes.append((host, int(port or 26379)))
    path = [p for p in parts.path.split("/") if p]
    if not path:
        raise ConfigError("a sentinel URL names the service: sentinel://host:port/mymaster")
    service = path[0]
    db = int(path[1]) if len(path) > 1 else int(parse_qs(parts.query).get("db", ["0"])[0])
    password = unquote(parts.password) if parts.password else None
    sentinel = redis.sentinel.Sentinel(  # type: ignore[no-untyped-call]
        nodes,
        socket_timeout=socket_timeout,
        sentinel_kwargs={"password": password} if password else None,
    )
    master: redis.Redis = sentinel.master_for(  # type: ignore[no-untyped-call]
        service,
        db=db,
        password=password,
        socket_timeout=socket_timeout,
        socket_connect_timeout=socket_timeout,
        decode_responses=True,
        client_name=client_name,
    )
    return master


class MasterWatch:
    """Notices that the sentinels named a new master while our connections to the old one
    still work.

    After ``SENTINEL FAILOVER`` the old master stays a writable master until a sentinel
    reconfigures it, about 10 s later (sentinels poll ``INFO`` every 10 s). redis-py asks
    the sentinels only when it opens a connection, so a client whose connections stay up
    keeps writing to the old master for those 10 s: leases, rate state and beat claims
    that the new master never sees, and that vanish when the old one resyncs (seen: a
    beat fired 11 slots a second time). A thread per process asks the sentinels every
    ``interval`` seconds; on a change redis-py drops its idle connections, and
    :meth:`generation` grows, which tells ``Scripts`` and ``PipelinedChannel`` to drop
    theirs. The window shrinks from ~10 s to about ``interval``.
    """

    def __init__(self, pool: Any, interval: float = MASTER_CHECK_INTERVAL) -> None:
        self._pool = pool
        self.interval = interval
        self._generation = 0
        self._pid = 0  # the process whose thread runs (a forked child starts its own)
        #: Called on the watch's thread after each master change (nothing may block it
        #: long: start a thread).
        self.on_change: list[Callable[[], None]] = []

    def generation(self) -> int:
        """How many master changes this process has seen; starts the watch on first use."""
        if self._pid != os.getpid():
            self._pid = os.getpid()
            threading.Thread(target=self._run, name="baton-master-watch", daemon=True).start()
        return self._generation

    def down_after(self) -> float:
        """The sentinels' ``down-after-milliseconds`` for this master, in seconds
        (Sentinel's default, 30 s, when none answers)."""
        manager = getattr(self._pool, "sentinel_manager", None)
        service = getattr(self._pool, "service_name", None)
        for sentinel in getattr(manager, "sentinels", ()):
            try:
                state = sentinel.sentinel_master(service)
                return float(state["down-after-milliseconds"]) / 1000
            except Exception:  # a sentinel down, or an answer without it: ask the next
                continue
        return DEFAULT_DOWN_AFTER

    def _run(self) -> None:
        pid = self._pid
        last: Any = None
        while pid == self._pid:
            try:
                # Also drops redis-py's idle connections when the address changed.
                address = self._pool.get_master_address()
            except Exception:  # sentinels unreachable: keep what we have, ask again
                address = None
            if address is not None:
                if last is not None and address != last:
                    self._generation += 1
                    logger.warning(
                        "store master changed from %s:%s to %s:%s; reconnecting", *last, *address
                    )
                    for listener in list(self.on_change):
                        try:
                            listener()
                        except Exception:  # one listener must not stop the watch
                            logger.exception("baton: a master change listener failed")
                last = address
            time.sleep(self.interval)


__all__ = [
    "EMBEDDED_URL",
    "Store",
    "connect",
    "ensure_embedded_server",
    "redact_url",
    "stop_embedded_server",
]
