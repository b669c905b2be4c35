"""Typos and misplaced options are errors with a suggestion, never silence (issue 13 §2).

Pure declaration-time checks: no server is needed to refuse them.
"""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from celery_baton import Baton, ConfigError
from celery_baton.config import read_settings


@pytest.fixture
def app() -> Celery:
    app = Celery("typos", set_as_current=False)
    Baton(app, url="redis://127.0.0.1:1/0")  # never connected by these tests
    return app


def test_an_unknown_baton_setting_is_refused_with_a_suggestion() -> None:
    app = Celery("typos", set_as_current=False)
    app.conf.baton_uri = "redis://127.0.0.1:6379/1"
    with pytest.raises(ConfigError, match=r"baton_uri: .*did you mean `baton_url`"):
        read_settings(app.conf)


def test_a_beat_entry_option_written_as_a_setting_is_refused_saying_where_it_goes() -> None:
    """``baton_misfire`` is an entry's option; as an app setting it was refused with no
    word of that (the beat guide's "set baton_misfire" invites it)."""
    app = Celery("typos", set_as_current=False)
    app.conf.baton_misfire = "all"
    with pytest.raises(ConfigError, match=r"baton_misfire: .*a beat entry's option"):
        read_settings(app.conf)


class DjangoLikeSettings:
    """A settings module read with Celery's namespace, as Django projects do."""

    CELERY_BROKER_URL = "redis://127.0.0.1:1/0"
    CELERY_BATON_URL = "redis://127.0.0.1:1/1"
    CELERY_BATON_LEASE_TLL = 20  # the typo
    CELERY_BATON_LEASE_TTL = 20
    DEBUG = True  # the project's own settings are not ours


def test_a_namespaced_setting_typo_is_refused_spelt_as_written() -> None:
    """``CELERY_BATON_LEASE_TLL`` under ``namespace="CELERY"`` was silently ignored: the
    check only looked at keys starting with ``baton_``."""
    app = Celery("typos", set_as_current=False)
    app.config_from_object(DjangoLikeSettings, namespace="CELERY")
    with pytest.raises(ConfigError) as error:
        read_settings(app.conf)
    message = str(error.value)
    assert "`CELERY_BATON_LEASE_TLL` (did you mean `CELERY_BATON_LEASE_TTL`?)" in message
    assert "CELERY_BATON_URL`" not in message and "DEBUG" not in message


def test_namespaced_settings_without_a_typo_are_read() -> None:
    app = Celery("typos", set_as_current=False)
    settings = {k: v for k, v in vars(DjangoLikeSettings).items() if k.isupper()}
    del settings["CELERY_BATON_LEASE_TLL"]
    app.config_from_object(settings, namespace="CELERY")
    read = read_settings(app.conf)
    assert read.lease_ttl == 20
    assert read.url == "redis://127.0.0.1:1/1"


def test_a_shared_task_typo_is_refused_at_its_first_publish(app: Celery) -> None:
    """``@shared_task(uniqe=...)``: Celery makes it with ``app._task_from_fun`` (as
    here, without registering a shared task in every later test's app), not through the
    ``app.task`` that Baton(app) checks. Its publish went out unguarded; only a worker
    refused to start."""
    app.conf.broker_url = "memory://"

    def build_report(report_id: int) -> None: ...

    task = app._task_from_fun(build_report, name="typos.build_report", uniqe="report_id")
    with pytest.raises(ConfigError, match=r"typos\.build_report: .*did you mean `unique`"):
        task.delay(1)
    with pytest.raises(ConfigError, match="did you mean `unique`"):  # every time
        task.delay(1)


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("127.0.0.1:6379", "no scheme"),
        ("http://127.0.0.1:6379/0", "unsupported scheme"),
        ("redis://:secret@127.0.0.1:6379/one", "must be a number"),
    ],
)
def test_a_bad_store_url_is_refused_naming_baton_url(url: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why) as error:
        read_settings({}, url)
    assert str(error.value).startswith("baton_url:")
    assert "secret" not in str(error.value)


@pytest.mark.parametrize(
    ("url", "meant"),
    [
        ("redis:/127.0.0.1:16399", "redis://127.0.0.1:16399"),
        ("redis:127.0.0.1:16399/2", "redis://127.0.0.1:16399/2"),
        ("rediss:/:secret@store.example.com:6380/0", "rediss://store.example.com:6380/0"),
        ("sentinel:/127.0.0.1:26379/mymaster", "sentinel://127.0.0.1:26379/mymaster"),
    ],
)
def test_a_store_url_missing_a_slash_is_refused_as_having_no_host(url: str, meant: str) -> None:
    """Before: ``'redis:/127.0.0.1:16399': the database must be a number, got
    '127.0.0.1:16399'``: the host read as the database, the missing slash unsaid."""
    with pytest.raises(ConfigError) as error:
        read_settings({}, url)
    message = str(error.value)
    assert message.startswith("baton_url:"), message
    assert f"has no host (did you mean {meant}?)" in message, message
    assert "secret" not in message, message


@pytest.mark.parametrize("url", ["redis://", "redis:///1", "unix:/tmp/store.sock"])
def test_a_store_url_without_a_host_on_purpose_is_read(url: str) -> None:
    """redis-py's own defaults: no host is localhost; a unix URL has a path, no host."""
    assert read_settings({}, url).url == url


@pytest.mark.parametrize(
    ("options", "suggested"),
    [
        ({"exclusiv": "feed_url"}, "exclusive"),
        ({"global_rate_limt": "5/s"}, "global_rate_limit"),
        ({"uniqe": "feed_url"}, "unique"),
        ({"exclusive": "feed_url", "exclusive_conflit": "wait"}, "exclusive_conflict"),
    ],
)
def test_a_misspelt_task_option_is_refused_with_a_suggestion(
    app: Celery, options: dict[str, Any], suggested: str
) -> None:
    with pytest.raises(ConfigError, match=f"did you mean `{suggested}`"):

        @app.task(**options)
        def import_feed(feed_url: str) -> None: ...


@pytest.mark.parametrize(
    "options",
    [
        {"exclusive_conflict": "wait"},
        {"unique_until": "started"},
        {"global_rate_limit_burst": 3},
        {"global_concurrency_key": "feed_url"},
    ],
)
def test_an_option_without_the_one_it_qualifies_is_refused(
    app: Celery, options: dict[str, Any]
) -> None:
    with pytest.raises(ConfigError, match="needs"):

        @app.task(**options)
        def import_feed(feed_url: str) -> None: ...


def test_celerys_own_options_are_not_mistaken_for_typos(app: Celery) -> None:
    @app.task(
        queue="feeds",
        rate_limit="1/s",
        autoretry_for=(ValueError,),
        acks_late=True,
        expires=10,
        exclusive="feed_url",
    )
    def import_feed(feed_url: str) -> None: ...

    @app.task
    def plain() -> None: ...

    assert import_feed.exclusive == "feed_url"


def test_the_typed_options_are_the_options_the_library_reads() -> None:
    from celery_baton import TaskOptions
    from celery_baton.core.policy.options import TASK_OPTIONS

    assert set(TaskOptions.__annotations__) == set(TASK_OPTIONS)
