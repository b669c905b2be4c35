"""The ``baton_*`` settings, read from ``app.conf`` (or ``CELERY_BATON_*`` with a namespace).

Every key is documented in docs/configuration.md. Celery-free: takes any mapping.
"""

from __future__ import annotations

import difflib
import ipaddress
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any
from urllib.parse import SplitResult, parse_qs, urlencode, urlsplit, urlunsplit

from celery_baton.errors import ConfigError

ON_STORE_ERROR = ("hold", "run")
#: Store URL schemes (docs/configuration.md); anything else is refused at resolution.
URL_SCHEMES = (
    "redis",
    "rediss",
    "unix",
    "sentinel",
    "sentinels",
    "redis+cluster",
    "rediss+cluster",
    "embedded",
)


#: The values of ``baton_unique_conflict``: the task option's (``core.policy.options.
#: UniqueConflict``, above this layer; a unit test holds them equal).
UNIQUE_CONFLICT_DEFAULTS = ("return", "raise", "replace")


@dataclass(frozen=True)
class Settings:
    """Resolved settings. All durations are in seconds."""

    url: str | None = None
    #: Where ``url`` came from (not a setting): "Baton(url=)", "baton_url", "$BATON_URL",
    #: "broker_url" (the broker's Redis), or "embedded" (no URL: the embedded store).
    url_source: str = field(default="embedded", metadata={"setting": False})
    on_store_error: str = "hold"
    socket_timeout: float = 2.0
    lease_ttl: float = 8.0
    global_rate_limits: bool = False
    redelivery_guard: bool = False
    redelivery_retention: float = 24 * 3600.0
    hold_max: int = 10_000
    hold_horizon: float = 300.0
    unique_ttl: float = 3600.0
    #: How long an ordered key waits for a position whose call does not come (ordered=,
    #: core/ordered.py) before it skips it; a task's ``ordered_gap_timeout`` overrides it.
    ordered_gap_timeout: float = 60.0
    #: How long a cancel (baton.cancel) is kept; None: the broker's visibility timeout
    #: when it has one, else a day (cancel.py).
    cancel_ttl: float | None = None
    #: Every unique task's ``unique_conflict`` unless it declares one (as celery-singleton's
    #: ``singleton_raise_on_duplicate``).
    unique_conflict: str = "return"
    key_prefix: str = "baton"
    metrics_port: int | None = None
    # Named limits shared by tasks (shared_limits.py): the raw ``baton_limits`` mapping;
    # None: not read (a task declared before the app's settings are known).
    limits: Any = None
    # beat (docs/beat.md)
    beat_lease_ttl: float = 6.0
    beat_history: int = 20
    beat_misfire_grace: float = 30.0
    beat_misfire_max: int = 100
    beat_check_tasks: bool = True
    #: How often the Django scheduler's leader asks whether django-celery-beat's tables
    #: changed (beat/django.py).
    beat_django_poll: float = 2.0


def _get(conf: Mapping[str, Any], name: str, default: Any) -> Any:
    for key in (f"baton_{name}", f"BATON_{name.upper()}"):
        try:
            value = conf[key]
        except (KeyError, AttributeError):
            continue
        if value is not None:
            return value
    return default


def _bool(value: Any, name: str) -> bool:
    """Booleans also arrive as strings from the environment (Django settings, $VARS)."""
    if isinstance(value, str):
        lowered = value.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off", ""):
            return False
        raise ConfigError(f"expected a boolean, got {value!r}", subject=f"baton_{name}")
    return bool(value)


def _seconds(value: Any, name: str) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"expected seconds, got {value!r}", subject=f"baton_{name}") from None
    if seconds <= 0:
        raise ConfigError(f"must be > 0, got {value!r}", subject=f"baton_{name}")
    return seconds


def suggest(word: str, known: Iterable[str]) -> str:
    """`` (did you mean `exclusive`?)`` for a near miss, else ``""``."""
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=0.75)
    return f" (did you mean `{close[0]}`?)" if close else ""


def check_setting_names(conf: Mapping[str, Any]) -> None:
    """An unknown ``baton_*`` key is a typo (``baton_uri``): refuse it, never ignore it."""
    known = {f.name for f in fields(Settings) if f.metadata.get("setting", True)}
    # Celery's namespace (``config_from_object(..., namespace="CELERY")``, the Django
    # setup): its settings are CELERY_BATON_LEASE_TTL, so a typo there
    # (CELERY_BATON_LEASE_TLL) was not seen as ours and silently ignored.
    keys = list(conf.keys())  # first: it configures a pending app.conf, which sets prefix
    namespace = getattr(conf, "prefix", None) or ""
    unknown = []
    for key in keys:
        if not isinstance(key, str):
            continue
        spelt = key
        if namespace and key.upper().startswith(namespace.upper()):
            spelt = key[len(namespace) :]
        if not spelt.lower().startswith("baton_"):
            continue
        name = spelt[len("baton_") :].lower()
        if name not in known:
            hint = suggest(f"baton_{name}", _setting_keys(known))
            if f"baton_{name}" in BEAT_ENTRY_OPTIONS:
                hint = (
                    f" (a beat entry's option: options={{'baton_{name}': ...}} in the entry; "
                    "app-wide: baton_beat_misfire_grace, baton_beat_misfire_max)"
                )
            if hint and key.isupper():  # spelt as written: CELERY_BATON_LEASE_TTL
                meant = hint.split("`")[1]
                hint = f" (did you mean `{key[: len(key) - len(spelt)]}{meant.upper()}`?)"
            unknown.append(f"`{key}`" + hint)
    if unknown:  # every typo at once: fixing them one run at a time wastes an afternoon
        raise ConfigError(
            f"unknown celery-baton setting{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)}",
            subject=unknown[0].split("`")[1] if len(unknown) == 1 else "settings",
        )


#: A beat entry's own options (in the entry's ``options``; beat/entries.py checks them
#: there): here too, to say so of one written as an app setting.
BEAT_ENTRY_OPTIONS = (
    "baton_misfire",
    "baton_misfire_grace",
    "baton_misfire_max",
    "baton_overlap",
    "baton_timezone",
)


def _setting_keys(known: Iterable[str]) -> list[str]:
    return [f"baton_{name}" for name in known]


def check_url(url: str) -> None:
    """Refuse a store URL that cannot work, naming ``baton_url`` (the password redacted)."""
    parts = urlsplit(url)
    shown = parts._replace(netloc=parts.netloc.rsplit("@", 1)[-1]).geturl() if parts.netloc else url
    if parts.scheme not in URL_SCHEMES:
        # "host:port" has no scheme; Python 3.10's urlsplit reads "host" as one.
        scheme = parts.scheme if "://" in url else ""
        raise ConfigError(
            f"{shown!r} has {'no' if not scheme else 'an unsupported'} scheme; use one "
            f"of {', '.join(s + '://' for s in URL_SCHEMES)}",
            subject="baton_url",
        )
    if parts.scheme != "unix":
        _check_host(parts, url)
        _check_ports(parts.netloc.rsplit("@", 1)[-1], shown)
    if parts.scheme in ("redis", "rediss", "unix"):
        db = parse_qs(parts.query).get("db", [""])[0]
        if parts.scheme != "unix" and parts.path.strip("/"):
            db = parts.path.strip("/")
        if db and not (db.isdigit() and int(db) < 1_000_000):
            raise ConfigError(
                f"{shown!r}: the database must be a number, got {db!r}", subject="baton_url"
            )


def _check_host(parts: SplitResult, url: str) -> None:
    """``redis:/host:port`` (a slash missing) has no host, only a path: it was refused as
    "the database must be a number, got 'host:port'" (its password shown), or a Sentinel
    URL went on to ask a sentinel named "". A URL without a host on purpose (``redis://``,
    ``redis:///1``: redis-py's localhost) has no path, or a database number as its path:
    only a path that starts like an address (``host:port``, a dotted name, ``:pw@``) is
    taken for a misplaced host."""
    first = parts.path.lstrip("/").split("/", 1)[0]
    if parts.netloc or not any(mark in first for mark in ":.@"):
        return
    host = first.rsplit("@", 1)[-1]  # the password hidden
    given = url.replace(first, host, 1)
    meant = f"{parts.scheme}://{given.split(':', 1)[1].lstrip('/')}"
    raise ConfigError(f"{given!r} has no host (did you mean {meant}?)", subject="baton_url")


def _check_ports(hosts: str, shown: str) -> None:
    """Every ``host:port`` of a URL's host list (Sentinel and cluster URLs name several)
    has a port that is a number: redis-py raises a bare ValueError deep in a publish."""
    for host in hosts.split(","):
        port = host.rsplit("]", 1)[-1].rpartition(":")[2] if ":" in host.rsplit("]", 1)[-1] else ""
        if port and not (port.isdigit() and 0 < int(port) < 65536):
            raise ConfigError(
                f"{shown!r}: the port must be a number from 1 to 65535, got {port!r}",
                subject="baton_url",
            )


def read_settings(conf: Mapping[str, Any], url: str | None = None) -> Settings:
    """Settings from a Celery ``app.conf``; ``url`` (from ``Baton(app, url=...)``) wins."""
    check_setting_names(conf)
    store_url, source = resolve_store_url(
        given=url,
        setting=_get(conf, "url", None),
        environ=os.environ.get("BATON_URL"),
        broker=_broker_url(conf),
    )
    if store_url:
        check_url(store_url)
    policy = str(_get(conf, "on_store_error", "hold"))
    if policy not in ON_STORE_ERROR:
        raise ConfigError(
            f"must be one of {ON_STORE_ERROR}, got {policy!r}", subject="baton_on_store_error"
        )
    unique_conflict = str(_get(conf, "unique_conflict", "return"))
    if unique_conflict not in UNIQUE_CONFLICT_DEFAULTS:
        raise ConfigError(
            f"must be one of {UNIQUE_CONFLICT_DEFAULTS}, got {unique_conflict!r}"
            + suggest(unique_conflict, UNIQUE_CONFLICT_DEFAULTS),
            subject="baton_unique_conflict",
        )
    hold_max = int(_get(conf, "hold_max", 10_000))
    if hold_max < 0:
        raise ConfigError("must be >= 0", subject="baton_hold_max")
    return Settings(
        url=store_url,
        url_source=source,
        on_store_error=policy,
        socket_timeout=_seconds(_get(conf, "socket_timeout", 2.0), "socket_timeout"),
        lease_ttl=_seconds(_get(conf, "lease_ttl", 8.0), "lease_ttl"),
        global_rate_limits=_bool(_get(conf, "global_rate_limits", False), "global_rate_limits"),
        redelivery_guard=_bool(_get(conf, "redelivery_guard", False), "redelivery_guard"),
        redelivery_retention=_seconds(
            _get(conf, "redelivery_retention", 24 * 3600.0), "redelivery_retention"
        ),
        hold_max=hold_max,
        hold_horizon=_seconds(_get(conf, "hold_horizon", 300.0), "hold_horizon"),
        unique_ttl=_seconds(_get(conf, "unique_ttl", 3600.0), "unique_ttl"),
        ordered_gap_timeout=_seconds(
            _get(conf, "ordered_gap_timeout", 60.0), "ordered_gap_timeout"
        ),
        cancel_ttl=_optional_seconds(_get(conf, "cancel_ttl", None), "cancel_ttl"),
        unique_conflict=unique_conflict,
        key_prefix=str(_get(conf, "key_prefix", "baton")),
        metrics_port=_get(conf, "metrics_port", None),
        limits=_get(conf, "limits", {}),
        beat_lease_ttl=_seconds(_get(conf, "beat_lease_ttl", 6.0), "beat_lease_ttl"),
        beat_history=_positive_int(_get(conf, "beat_history", 20), "beat_history"),
        beat_misfire_grace=float(_get(conf, "beat_misfire_grace", 30.0)),
        beat_misfire_max=_positive_int(_get(conf, "beat_misfire_max", 100), "beat_misfire_max"),
        beat_check_tasks=_bool(_get(conf, "beat_check_tasks", True), "beat_check_tasks"),
        beat_django_poll=_seconds(_get(conf, "beat_django_poll", 2.0), "beat_django_poll"),
    )


def _optional_seconds(value: Any, name: str) -> float | None:
    return None if value is None else _seconds(value, name)


def _positive_int(value: Any, name: str) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"expected an integer, got {value!r}", subject=f"baton_{name}") from None
    if number < 1:
        raise ConfigError(f"must be >= 1, got {value!r}", subject=f"baton_{name}")
    return number


# -- where the store is when no URL names it -----------------------------------------

#: Brokers whose server is a Redis: with no store URL, that server is the store.
REDIS_BROKERS = ("redis", "rediss")
#: kombu's Redis over a unix socket: ``redis+socket:///path.sock?virtual_host=0``.
REDIS_SOCKET_BROKER = "redis+socket"
#: Brokers that live in the process or on this machine's disk.
LOCAL_BROKERS = ("memory", "filesystem")
#: Brokers whose URL without a host means localhost (kombu's default host).
LOCALHOST_BY_DEFAULT = ("amqp", "amqps", "pyamqp", "librabbitmq", "sentinel")
#: Host names that are this machine by definition (no DNS is asked).
LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback")
#: TLS options of a ``rediss://`` broker URL that redis-py reads from the URL too.
_SSL_QUERY = ("ssl_cert_reqs", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile")


def _broker_url(conf: Mapping[str, Any]) -> Any:
    """The broker URL Celery connects to: ``app.conf.broker_url`` (which also reads
    ``$CELERY_BROKER_URL``), or the key of a plain mapping."""
    value = getattr(conf, "broker_url", None)
    if value is None and isinstance(conf, Mapping):
        value = conf.get("broker_url")
    return value


def resolve_store_url(
    *, given: Any = None, setting: Any = None, environ: Any = None, broker: Any = None
) -> tuple[str | None, str]:
    """``(store URL, where it came from)``; ``None`` is the embedded store.

    A URL named anywhere wins: ``Baton(app, url=...)``, then ``baton_url``, then
    ``$BATON_URL``. With none, the store follows the broker, so that workers on several
    machines never coordinate each on its own without a word:

    * a Redis broker (``redis://``, ``rediss://``, ``redis+socket://``): its server is
      the store, as celery-singleton and celery-redbeat do;
    * a broker on this machine (``memory://``, ``filesystem://``, a loopback host, no
      host), or none (Celery's default, ``amqp://localhost``): the embedded store;
    * any other broker (RabbitMQ, SQS, Sentinel... on another host): refused, naming
      ``baton_url``: each machine's embedded store would coordinate that machine alone.
    """
    for value, source in ((given, "Baton(url=)"), (setting, "baton_url"), (environ, "$BATON_URL")):
        if value:
            return str(value), source
    first = _first_broker(broker)
    if first is None:
        return None, "embedded"
    parts = urlsplit(first)
    scheme = parts.scheme.lower()
    if scheme in REDIS_BROKERS:
        query = {k: v[-1] for k, v in parse_qs(parts.query).items() if k in _SSL_QUERY}
        if "ssl_cert_reqs" in query:  # kombu takes CERT_REQUIRED, redis-py "required"
            query["ssl_cert_reqs"] = query["ssl_cert_reqs"].lower().removeprefix("cert_")
        kept = f"?{urlencode(query)}" if query else ""
        return f"{parts.scheme}://{parts.netloc}{parts.path}{kept}", "broker_url"
    if scheme == REDIS_SOCKET_BROKER:
        path = parts.netloc + parts.path
        db = parse_qs(parts.query).get("virtual_host", ["0"])[-1] or "0"
        return f"unix://{path}?db={db}", "broker_url"
    if _on_this_machine(scheme, parts.hostname or ""):
        return None, "embedded"
    raise ConfigError(
        f"no store URL is set and the broker {_shown(first)} is not on this machine: "
        "workers on several machines would each coordinate on their own machine's "
        "embedded store. Set baton_url (or $BATON_URL) to a Redis or Valkey that every "
        "machine reaches, or to 'embedded://' to coordinate each machine on its own",
        subject="baton_url",
    )


def _first_broker(broker: Any) -> str | None:
    """The first URL of a broker setting (a list, or ``;``-separated failover URLs)."""
    if not broker:
        return None
    first = broker[0] if isinstance(broker, list | tuple) else str(broker).split(";")[0]
    return str(first).strip() or None


def _on_this_machine(scheme: str, host: str) -> bool:
    """Judged from the URL alone (no DNS): a name another machine would read the same."""
    if scheme in LOCAL_BROKERS:
        return True
    if not host:
        return scheme in LOCALHOST_BY_DEFAULT
    host = host.lower().rstrip(".")
    if host in LOOPBACK_NAMES or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _shown(url: str) -> str:
    """The URL without its password, for an error message."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user, host = parts.netloc.rsplit("@", 1)
    return urlunsplit(parts._replace(netloc=f"{user.split(':')[0]}:***@{host}"))
