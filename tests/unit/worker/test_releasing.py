"""How long a unique claim is kept for the copy of a run whose broker ack failed."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery
from kombu.transport.redis import Channel

from celery_baton.core.gate import Release
from celery_baton.worker.releasing import Releasing
from celery_baton.worker.transport.broker import read_broker, restore_scan_period


def _redelivery_window(app: Celery) -> float | None:
    return read_broker(app).redelivery_window


def _app(broker: str, **options: Any) -> Celery:
    app = Celery("window", broker=broker, set_as_current=False)
    app.conf.broker_transport_options = options
    return app


#: Whether kombu's Redis transport takes its restore scan's period from the transport
#: options (kombu 5.7); before, it scans every 100 s whatever they say.
SCAN_SETTINGS = "unacked_restore_throttle" in getattr(Channel, "from_transport_options", ())


def test_redis_window_covers_the_visibility_timeout_twice_the_restore_scan_and_mutex() -> None:
    app = _app("redis://127.0.0.1:1/0", visibility_timeout=10, unacked_restore_interval=1)
    scan = 1 * 10 if SCAN_SETTINGS else 100  # (throttle 10)
    assert _redelivery_window(app) == 2 * 10 + scan + 300  # (mutex 300 s)
    assert _redelivery_window(_app("redis://127.0.0.1:1/0")) == 2 * 3600 + 100 + 300
    app = _app("redis://127.0.0.1:1/0", visibility_timeout=10, unacked_mutex_expire=5)
    assert _redelivery_window(app) == 2 * 10 + 100 + 5


def test_the_restore_scan_is_kombus_own_period_where_the_options_are_not_settings() -> None:
    """kombu before 5.7 scans every 100 s: an app asking 1 s (as the tests' do) has a
    window that long, not 99 s shorter (a held message left to the scan on Celery 5.3
    came back 100 s after the worker reconnected)."""
    options = {"unacked_restore_interval": 1, "unacked_restore_throttle": 1}
    assert restore_scan_period(options) == (1 if SCAN_SETTINGS else 100)
    assert restore_scan_period({}) == 100


def test_amqp_has_no_window() -> None:
    assert _redelivery_window(_app("amqp://guest@127.0.0.1:1//")) is None


@pytest.mark.parametrize(
    ("window", "unique_ttl", "kept"),
    [(30.0, 3600.0, 30.0), (7300.0, 3600.0, 3600.0), (None, 600.0, 600.0), (0.0, 60.0, 1.0)],
)
def test_kept_claim_is_bounded_by_unique_ttl(
    window: float | None, unique_ttl: float, kept: float
) -> None:
    releasing = Releasing(book=None, timer=None, unsent=None, redelivery_window=window)  # type: ignore[arg-type]
    policy: Any = SimpleNamespace(unique_ttl=unique_ttl)
    assert releasing.unacked_claim_ttl(policy) == kept


def test_release_sends_the_keep_ttl_only_with_a_unique_key() -> None:
    keys, args = Release((), "t|w|n", None, 0.0, "u", "t", 9.0).script_call("c")
    assert keys == ["u"] and args[-1] == 9000
    keys, args = Release((), "t|w|n", None, 0.0, None, "", 9.0).script_call("c")
    assert keys == [] and args[-1] == 0
