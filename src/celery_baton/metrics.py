"""Prometheus metrics (extra ``prometheus``); every call is a no-op until they are served.

Set ``baton_metrics_port`` to serve them from each worker (and beat) process: a port,
or a range ``"9100-9119"`` when several processes run on one host (each takes the first
free port of it and logs which). The store-wide view of every worker, from one place,
is ``/metrics`` of ``celery -A proj baton web`` (see :mod:`celery_baton.ops.web.metrics`).
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from celery_baton.errors import ConfigError

logger = logging.getLogger("celery_baton.metrics")

_prom: Any
try:
    _prom = importlib.import_module("prometheus_client")
except ImportError:  # pragma: no cover - the extra is optional
    _prom = None


class _Noop:
    def labels(self, *args: Any, **kwargs: Any) -> _Noop:
        return self

    def inc(self, amount: float = 1) -> None:
        pass

    def set(self, value: float) -> None:
        pass

    def observe(self, value: float) -> None:
        pass


_NOOP = _Noop()
_all: list[_Metric] = []


class _Metric:
    """A metric that costs nothing until ``serve()`` creates the real one: the hot path
    of a worker that exports no metrics must not pay for them."""

    def __init__(self, kind: str, name: str, doc: str, labels: tuple[str, ...] = ()) -> None:
        self.kind, self.name, self.doc, self.label_names = kind, name, doc, labels
        self.real: Any = None
        _all.append(self)

    def enable(self) -> None:
        if self.real is None and _prom is not None:
            self.real = getattr(_prom, self.kind)(self.name, self.doc, self.label_names)

    def labels(self, *values: str) -> Any:
        return _NOOP if self.real is None else self.real.labels(*values)

    def inc(self, amount: float = 1) -> None:
        if self.real is not None:
            self.real.inc(amount)

    def set(self, value: float) -> None:
        if self.real is not None:
            self.real.set(value)

    def observe(self, value: float) -> None:
        if self.real is not None:
            self.real.observe(value)


def _counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> _Metric:
    return _Metric("Counter", name, doc, labels)


def _gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> _Metric:
    return _Metric("Gauge", name, doc, labels)


def _histogram(name: str, doc: str, labels: tuple[str, ...] = ()) -> _Metric:
    return _Metric("Histogram", name, doc, labels)


admissions = _counter("baton_admissions_total", "Requests the gate admitted to the pool", ("task",))
skips = _counter("baton_skips_total", "Requests acked without running", ("task", "reason"))
holds = _counter("baton_holds_total", "Requests held in the consumer", ("task",))
hold_seconds = _histogram("baton_hold_seconds", "Time requests spent held", ("task",))
throttled = _counter("baton_throttled_total", "Gate denials by a rate limit", ("task",))
handed_back = _counter("baton_handed_back_total", "Held requests returned to the broker", ("task",))
held_now = _gauge("baton_held_requests", "Requests held in this worker now")
leases_now = _gauge("baton_leases", "Leases this worker holds now")
lease_renewals = _counter("baton_lease_renewals_total", "Leases renewed")
lease_losses = _counter("baton_lease_losses_total", "Leases found taken over at renewal")
beat_fired = _counter("baton_beat_slots_fired_total", "Beat slots fired", ("entry",))
beat_missed = _counter("baton_beat_slots_missed_total", "Beat slots missed", ("entry",))
beat_suppressed = _counter(
    "baton_beat_slots_suppressed_total", "Beat slots suppressed by the overlap policy", ("entry",)
)
beat_leader_changes = _counter(
    "baton_beat_leader_changes_total", "Times this beat process became the leader"
)


_served: int | None = None  # the port this process serves on


def parse_ports(value: int | str) -> range:
    """``9100`` or ``"9100-9119"`` -> the ports to try, in order.

    A range lets several worker (and beat) processes on one host share one setting:
    each takes the first free port of it."""
    text = str(value).strip()
    low, sep, high = text.partition("-")
    try:
        first = int(low)
        last = int(high) if sep else first
    except ValueError:
        raise ConfigError(
            f"expected a port or a range like 9100-9119, got {value!r}",
            subject="baton_metrics_port",
        ) from None
    if not 0 < first <= last <= 65535:
        raise ConfigError(
            f"ports must be 1-65535, low to high; got {value!r}", subject="baton_metrics_port"
        )
    return range(first, last + 1)


def serve(port: int | str | None) -> int | None:
    """Serve ``/metrics`` on ``port`` (or the first free port of a range ``"a-b"``) when
    it is set and prometheus-client is installed; returns the port, or None."""
    global _served
    if not port or _served is not None:
        return _served
    ports = parse_ports(port)
    if _prom is None:
        logger.warning(
            "baton_metrics_port is set but prometheus-client is not installed: "
            "pip install 'celery-baton[prometheus]'"
        )
        return None
    for metric in _all:
        metric.enable()
    # Binding is the test: a port another process listens on fails at once, so two
    # processes started together still end up on two ports.
    errors = []
    for candidate in ports:
        try:
            _prom.start_http_server(candidate)
        except OSError as exc:
            errors.append(f"{candidate}: {exc.strerror or exc}")
            continue
        _served = candidate
        logger.info("baton: serving Prometheus metrics on port %d (/metrics)", candidate)
        return candidate
    logger.warning(
        "cannot serve metrics on baton_metrics_port %s (%s); give a range like "
        "9100-9119 so that each process on this host finds a port of its own, or scrape "
        "the store-wide view of `celery baton web` (/metrics)",
        port,
        "; ".join(errors[:3]) + (" ..." if len(errors) > 3 else ""),
    )
    return None
