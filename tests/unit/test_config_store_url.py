"""Where the store is when no URL names it (config.resolve_store_url): pure logic.

A URL named anywhere wins; else a Redis broker's server is the store; else a broker on
this machine means the embedded store; any other broker is refused, naming baton_url.
The real processes: tests/store_choice/test_store_default.py.
"""

from __future__ import annotations

import pytest
from celery import Celery

from celery_baton import ConfigError
from celery_baton.config import read_settings, resolve_store_url


@pytest.fixture(autouse=True)
def _no_urls_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BATON_URL", raising=False)
    monkeypatch.delenv("CELERY_BROKER_URL", raising=False)


def test_a_url_named_anywhere_wins_over_the_broker() -> None:
    broker = "amqp://rabbit.internal//"  # refused below, but never looked at here
    assert resolve_store_url(given="redis://a/0", setting="redis://b/0", broker=broker) == (
        "redis://a/0",
        "Baton(url=)",
    )
    assert resolve_store_url(setting="redis://b/0", environ="redis://c/0", broker=broker) == (
        "redis://b/0",
        "baton_url",
    )
    assert resolve_store_url(environ="redis://c/0", broker=broker) == ("redis://c/0", "$BATON_URL")
    assert resolve_store_url(setting="embedded://", broker=broker) == ("embedded://", "baton_url")


@pytest.mark.parametrize(
    ("broker", "store"),
    [
        ("redis://10.0.0.5:6379/0", "redis://10.0.0.5:6379/0"),
        ("redis://:s3cret@redis.internal/3", "redis://:s3cret@redis.internal/3"),
        ("redis://127.0.0.1:6379/1", "redis://127.0.0.1:6379/1"),
        ("redis://", "redis://"),
        # kombu's options are dropped (redis-py refuses unknown ones); TLS ones are kept,
        # kombu's spelling of the certificate requirement turned into redis-py's.
        (
            "rediss://h:6380/0?ssl_cert_reqs=CERT_REQUIRED&visibility_timeout=10",
            "rediss://h:6380/0?ssl_cert_reqs=required",
        ),
        ("redis+socket:///run/redis.sock?virtual_host=4", "unix:///run/redis.sock?db=4"),
        ("redis+socket:///run/redis.sock", "unix:///run/redis.sock?db=0"),
        # failover URLs: the first, as Celery connects to it first
        ("redis://h1/0;redis://h2/0", "redis://h1/0"),
        (["redis://h1/0", "redis://h2/0"], "redis://h1/0"),
    ],
)
def test_a_redis_broker_is_the_store(broker: object, store: str) -> None:
    assert resolve_store_url(broker=broker) == (store, "broker_url")


@pytest.mark.parametrize(
    "broker",
    [
        None,  # Celery's default: amqp://guest@localhost//
        "",
        "amqp://guest:guest@localhost:5672//",
        "amqp://guest@127.0.0.1//",
        "pyamqp://127.0.0.2//",
        "amqp://[::1]:5672//",
        "amqp://LOCALHOST.//",
        "amqp://rabbit.localhost//",
        "amqp://",
        "memory://",
        "filesystem://",
        "sentinel://localhost:26379",
    ],
)
def test_a_broker_on_this_machine_means_the_embedded_store(broker: str | None) -> None:
    assert resolve_store_url(broker=broker) == (None, "embedded")


@pytest.mark.parametrize(
    "broker",
    [
        "amqp://guest:s3cret@rabbit.internal:5672//",
        "amqp://10.0.0.5//",
        "amqps://b-1234.mq.eu-west-1.amazonaws.com:5671//",
        "pyamqp://192.0.2.2:5672//",  # this machine's own address: others reach it too
        "sqs://",  # no host: AWS, not this machine
        "sentinel://10.0.0.1:26379;sentinel://10.0.0.2:26379",
        "amqp://myhost//",
    ],
)
def test_a_remote_broker_that_is_not_redis_is_refused_naming_baton_url(broker: str) -> None:
    with pytest.raises(ConfigError) as error:
        resolve_store_url(broker=broker)
    message = str(error.value)
    assert message.startswith("baton_url: no store URL is set and the broker ")
    assert "embedded://" in message and "\n" not in message
    assert "s3cret" not in message


def test_the_app_s_broker_is_read_as_celery_reads_it(monkeypatch: pytest.MonkeyPatch) -> None:
    app = Celery("x", broker="redis://broker.internal:6379/2", set_as_current=False)
    settings = read_settings(app.conf)
    assert (settings.url, settings.url_source) == ("redis://broker.internal:6379/2", "broker_url")
    assert read_settings(Celery("y", set_as_current=False).conf).url is None
    # Celery's $CELERY_BROKER_URL wins over the app's broker: the store follows it.
    monkeypatch.setenv("CELERY_BROKER_URL", "redis://other:6379/0")
    assert read_settings(app.conf).url == "redis://other:6379/0"
    app.conf.baton_url = "redis://store:6379/0"
    assert read_settings(app.conf).url_source == "baton_url"


def test_where_the_url_came_from_is_not_a_setting() -> None:
    with pytest.raises(ConfigError, match="baton_url_source: unknown celery-baton setting"):
        read_settings({"baton_url_source": "broker_url"})
