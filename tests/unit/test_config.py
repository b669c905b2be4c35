"""Settings as config.py resolves them from a Celery ``app.conf`` (a plain mapping here):
defaults, the upper-case spelling, values that arrive as strings, and a clear error
naming the setting for a value that cannot work. (Typos: tests/unit/test_config_typos.py.)"""

from __future__ import annotations

from typing import Any

import pytest

from celery_baton import ConfigError
from celery_baton.config import Settings, read_settings


@pytest.fixture(autouse=True)
def _no_url_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BATON_URL", raising=False)


def test_nothing_set_is_the_documented_defaults() -> None:
    # baton_limits read and empty (Settings() alone means "not read yet").
    assert read_settings({}) == Settings(limits={})


def test_strings_from_the_environment_are_read_as_their_types() -> None:
    settings = read_settings(
        {
            "baton_lease_ttl": "12.5",
            "baton_global_rate_limits": "yes",
            "baton_redelivery_guard": "off",
            "baton_beat_history": "5",
            "BATON_HOLD_MAX": "7",
        }
    )
    assert settings.lease_ttl == 12.5 and settings.global_rate_limits
    assert not settings.redelivery_guard and settings.beat_history == 5
    assert settings.hold_max == 7


def test_the_url_given_to_baton_wins_over_the_setting_and_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("BATON_URL", "redis://env:6379/0")
    assert read_settings({}).url == "redis://env:6379/0"
    assert read_settings({"baton_url": "redis://conf:6379/0"}).url == "redis://conf:6379/0"
    given = read_settings({"baton_url": "redis://conf:6379/0"}, url="redis://given:6379/0")
    assert given.url == "redis://given:6379/0"


@pytest.mark.parametrize(
    ("conf", "match"),
    [
        ({"baton_lease_ttl": 0}, r"baton_lease_ttl.*must be > 0"),
        ({"baton_socket_timeout": "soon"}, r"baton_socket_timeout.*expected seconds"),
        ({"baton_redelivery_guard": "maybe"}, r"baton_redelivery_guard.*expected a boolean"),
        ({"baton_on_store_error": "ignore"}, r"baton_on_store_error.*must be one of"),
        ({"baton_hold_max": -1}, r"baton_hold_max.*must be >= 0"),
        ({"baton_beat_history": 0}, r"baton_beat_history.*must be >= 1"),
        ({"baton_beat_misfire_max": "many"}, r"baton_beat_misfire_max.*expected an integer"),
    ],
)
def test_a_value_that_cannot_work_is_refused_naming_its_setting(
    conf: dict[str, Any], match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        read_settings(conf)
