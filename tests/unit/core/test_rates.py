"""Rate strings, and bad limit options refused when the task is declared (no server)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_baton import Baton, ConfigError, KeySpecError, RateSpecError
from celery_baton.core.rates import interval_us, parse_burst, parse_rate, rate_text


@pytest.mark.parametrize(
    ("value", "per_second"),
    [
        ("10/s", 10.0),
        ("10/m", 10 / 60),
        ("3600/h", 1.0),
        ("1/d", 1 / 86400),
        ("0.5/s", 0.5),
        (" 20 / s ", 20.0),
        ("5/sec", 5.0),
        ("5/min", 5 / 60),
        ("5/minute", 5 / 60),
        ("5/hour", 5 / 3600),
        ("7", 7.0),  # no unit: per second
        (7, 7.0),
        (2.5, 2.5),
    ],
)
def test_parse_rate(value: Any, per_second: float) -> None:
    assert parse_rate(value) == pytest.approx(per_second)


@pytest.mark.parametrize(
    "value",
    [
        "10/x",
        "10/",
        "-1/s",
        "0/s",
        "0",
        0,
        -1,
        -0.5,
        float("inf"),
        float("nan"),
        "",
        "fast",
        "1e3/s",
        "10 per second",
        True,
        None,
        [10],
    ],
)
def test_parse_rate_refuses(value: Any) -> None:
    with pytest.raises(RateSpecError):
        parse_rate(value)


def test_rate_error_names_its_subject() -> None:
    with pytest.raises(RateSpecError, match=r"^proj.fetch.global_rate_limit: .*'10/x'"):
        parse_rate("10/x", subject="proj.fetch.global_rate_limit")


@pytest.mark.parametrize("value", [0, -1, 1.5, "2", True, None])
def test_parse_burst_refuses(value: Any) -> None:
    with pytest.raises(RateSpecError):
        parse_burst(value)


def test_interval() -> None:
    assert interval_us(20) == 50_000
    assert interval_us(1 / 60) == 60_000_000
    assert interval_us(3) == 333_333
    assert interval_us(1e9) == 1  # never 0: a zero interval would mean no limit


# -- declaration-time errors, raised by the @app.task decorator ------------------------


@pytest.fixture
def app() -> Iterator[Celery]:
    # No broker or store is contacted: Baton connects on first use, and declaring a
    # task must not need either.
    app = Celery("declare", broker="memory://", set_as_current=False)
    Baton(app, url="redis://127.0.0.1:1/0")
    yield app
    app.close()


def fetch(host: str, path: str = "/") -> None:
    """The function the bad options are declared on."""


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"global_rate_limit": "10/x"}, RateSpecError, "unit"),
        ({"global_rate_limit": "-1/s"}, RateSpecError, "not a rate"),
        ({"global_rate_limit": "0/s"}, RateSpecError, "positive"),
        ({"global_rate_limit": 0}, RateSpecError, "positive"),
        ({"global_rate_limit": "10/s", "global_rate_limit_burst": 0}, RateSpecError, "burst"),
        ({"global_concurrency": 0}, ConfigError, "global_concurrency"),
        ({"global_concurrency": -1}, ConfigError, "global_concurrency"),
        ({"global_concurrency": 1.5}, ConfigError, "global_concurrency"),
        ({"global_concurrency": True}, ConfigError, "global_concurrency"),
        ({"global_rate_limit": "10/s", "global_rate_limit_key": "tenant"}, KeySpecError, "tenant"),
        (
            {"global_rate_limit": "10/s", "global_rate_limit_key": "{tenant}"},
            KeySpecError,
            "tenant",
        ),
        (
            {"global_rate_limit": "10/s", "global_rate_limit_key": ["host", "tenant"]},
            KeySpecError,
            "tenant",
        ),
        ({"global_concurrency": 2, "global_concurrency_key": "tenant"}, KeySpecError, "tenant"),
        ({"global_rate_limit_key": "host"}, ConfigError, "needs global_rate_limit"),
        ({"global_concurrency_key": "host"}, ConfigError, "needs global_concurrency"),
        ({"global_concurrency": 2, "lease_ttl": 0}, ConfigError, "lease_ttl"),
        ({"global_concurrency": 2, "lease_ttl": -3}, ConfigError, "lease_ttl"),
    ],
)
def test_bad_limits_fail_at_declaration(
    app: Celery, options: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match) as info:
        app.task(**options)(fetch)
    assert "fetch" in str(info.value)  # names the task (and option) it is about
    assert "tests.unit.core.test_rates.fetch" not in app.tasks


def test_bad_limit_fails_in_the_bare_decorator_form_too(app: Celery) -> None:
    with pytest.raises(KeySpecError, match="tenant"):

        @app.task(bind=True, global_concurrency=1, global_concurrency_key="tenant")
        def bound(self: Any, host: str) -> None: ...


def test_good_limits_declare(app: Celery) -> None:
    task = app.task(
        global_rate_limit="10/s",
        global_rate_limit_key="host",
        global_rate_limit_burst=3,
        global_concurrency=2,
        global_concurrency_key="{host}",
        lease_ttl=5,
    )(fetch)
    assert task.global_rate_limit == "10/s"
    assert task.global_concurrency == 2


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("10/S", "write 'N/s', 'N/m', 'N/h', 'N/d' (lower case)"),
        ("10/seconds", "use s, m, h or d (or sec, second, min, minute, hour, day)"),
    ],
)
def test_a_refused_rate_names_every_form_accepted(value: str, words: str) -> None:
    with pytest.raises(RateSpecError) as error:
        parse_rate(value, subject="t.global_rate_limit")
    assert words in str(error.value), error.value


@pytest.mark.parametrize(
    ("declared", "shown"),
    [
        ("10/m", "10/m"),  # was 0.166667/s
        ("7/m", "7/m"),
        ("100/h", "100/h"),
        ("3/d", "3/d"),
        ("5/s", "5/s"),
        ("90000/m", "1500/s"),  # the same rate, in whole runs a second
        ("2.5/s", "150/m"),
        (1 / 7, "0.142857/s"),  # no unit counts it in whole runs
    ],
)
def test_a_rate_is_shown_in_the_first_unit_that_counts_whole_runs(
    declared: str | float, shown: str
) -> None:
    """`celery baton limits`, the web view and an override's words show a rate as an
    operator writes it, not as a float a second."""
    assert rate_text(parse_rate(declared)) == shown
