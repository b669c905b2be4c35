"""The ``baton_*`` settings, read from ``app.conf`` (or ``CELERY_BATON_*`` with a namespace).

Every key is documented in docs/configuration.md. Celery-free: takes any mapping.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any
from urllib.parse import parse_qs, urlsplit

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


@dataclass(frozen=True)
class Settings:
    """Resolved settings. All durations are in seconds."""

    url: str | None = None
    on_store_error: str = "hold"
    socket_timeout: float = 2.0
    lease_ttl: float = 10.0
    global_rate_limits: bool = False
    redelivery_guard: bool = False
    redelivery_retention: float = 24 * 3600.0
    hold_max: int = 10_000
    hold_horizon: float = 300.0
    unique_ttl: float = 3600.0
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
    known = {f.name for f in fields(Settings)}
    for key in list(conf.keys()):
        if not isinstance(key, str) or not key.lower().startswith("baton_"):
            continue
        name = key[len("baton_") :].lower()
        if name not in known:
            raise ConfigError(
                "unknown celery-baton setting" + suggest(f"baton_{name}", _setting_keys(known)),
                subject=key,
            )


def _setting_keys(known: Iterable[str]) -> list[str]:
    return [f"baton_{name}" for name in known]


def check_url(url: str) -> None:
    """Refuse a store URL that cannot work, naming ``baton_url`` (the password redacted)."""
    parts = urlsplit(url)
    shown = parts._replace(netloc=parts.netloc.rsplit("@", 1)[-1]).geturl() if parts.netloc else url
    if parts.scheme not in URL_SCHEMES:
        raise ConfigError(
            f"{shown!r} has {'no' if not parts.scheme else 'an unsupported'} scheme; use one "
            f"of {', '.join(s + '://' for s in URL_SCHEMES)}",
            subject="baton_url",
        )
    if parts.scheme in ("redis", "rediss", "unix"):
        db = parse_qs(parts.query).get("db", [""])[0]
        if parts.scheme != "unix" and parts.path.strip("/"):
            db = parts.path.strip("/")
        if db and not (db.isdigit() and int(db) < 1_000_000):
            raise ConfigError(
                f"{shown!r}: the database must be a number, got {db!r}", subject="baton_url"
            )


def read_settings(conf: Mapping[str, Any], url: str | None = None) -> Settings:
    """Settings from a Celery ``app.conf``; ``url`` (from ``Baton(app, url=...)``) wins."""
    check_setting_names(conf)
    store_url = url or _get(conf, "url", None) or os.environ.get("BATON_URL") or None
    if store_url:
        check_url(str(store_url))
    policy = str(_get(conf, "on_store_error", "hold"))
    if policy not in ON_STORE_ERROR:
        raise ConfigError(
            f"must be one of {ON_STORE_ERROR}, got {policy!r}", subject="baton_on_store_error"
        )
    hold_max = int(_get(conf, "hold_max", 10_000))
    if hold_max < 0:
        raise ConfigError("must be >= 0", subject="baton_hold_max")
    return Settings(
        url=store_url,
        on_store_error=policy,
        socket_timeout=_seconds(_get(conf, "socket_timeout", 2.0), "socket_timeout"),
        lease_ttl=_seconds(_get(conf, "lease_ttl", 10.0), "lease_ttl"),
        global_rate_limits=_bool(_get(conf, "global_rate_limits", False), "global_rate_limits"),
        redelivery_guard=_bool(_get(conf, "redelivery_guard", False), "redelivery_guard"),
        redelivery_retention=_seconds(
            _get(conf, "redelivery_retention", 24 * 3600.0), "redelivery_retention"
        ),
        hold_max=hold_max,
        hold_horizon=_seconds(_get(conf, "hold_horizon", 300.0), "hold_horizon"),
        unique_ttl=_seconds(_get(conf, "unique_ttl", 3600.0), "unique_ttl"),
        key_prefix=str(_get(conf, "key_prefix", "baton")),
        metrics_port=_get(conf, "metrics_port", None),
        limits=_get(conf, "limits", {}),
        beat_lease_ttl=_seconds(_get(conf, "beat_lease_ttl", 6.0), "beat_lease_ttl"),
        beat_history=_positive_int(_get(conf, "beat_history", 20), "beat_history"),
        beat_misfire_grace=float(_get(conf, "beat_misfire_grace", 30.0)),
        beat_misfire_max=_positive_int(_get(conf, "beat_misfire_max", 100), "beat_misfire_max"),
        beat_check_tasks=_bool(_get(conf, "beat_check_tasks", True), "beat_check_tasks"),
    )


def _positive_int(value: Any, name: str) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"expected an integer, got {value!r}", subject=f"baton_{name}") from None
    if number < 1:
        raise ConfigError(f"must be >= 1, got {value!r}", subject=f"baton_{name}")
    return number
