"""Prometheus metrics (extra ``prometheus``); every call is a no-op until they are served.

Set ``baton_metrics_port`` to serve them from each worker (and beat) process.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

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


_served = False


def serve(port: int | None) -> None:
    """Serve ``/metrics`` on ``port`` when it is set and the package is installed."""
    global _served
    if not port or _served:
        return
    if _prom is None:
        logger.warning(
            "baton_metrics_port is set but prometheus-client is not installed: "
            "pip install 'celery-baton[prometheus]'"
        )
        return
    for metric in _all:
        metric.enable()
    try:
        _prom.start_http_server(int(port))
        _served = True
    except OSError as exc:
        logger.warning("cannot serve metrics on port %s: %s", port, exc)
