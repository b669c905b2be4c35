"""Bad input from a developer is one clear error naming what is wrong, every mistake at
once; what is somebody else's is left alone (issue 28 §5, §7, §8). No server needed."""

from __future__ import annotations

import math
import sys
from typing import Any

import pytest
from celery import Celery

from celery_baton import Baton, ConfigError
from celery_baton.config import read_settings
from celery_baton.parts import installed_parts
from celery_baton.publish import _refuse_orphan_once


@pytest.fixture
def app() -> Celery:
    app = Celery("input", set_as_current=False)
    Baton(app, url="redis://127.0.0.1:1/0")  # never connected by these tests
    return app


# -- §5: a port that is not a number, every typo at once --------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:notaport/1",
        "rediss://:secret@127.0.0.1:99999/0",
        "sentinel://127.0.0.1:26379,127.0.0.1:x/0",
    ],
)
def test_a_port_that_is_not_a_number_is_refused_naming_baton_url(url: str) -> None:
    with pytest.raises(ConfigError, match="port must be a number") as error:
        read_settings({}, url)
    assert str(error.value).startswith("baton_url:")
    assert "secret" not in str(error.value)


def test_good_ports_pass() -> None:
    for url in (
        "redis://127.0.0.1:6379/1",
        "redis://[::1]:6379/0",
        "redis://localhost/0",
        "sentinel://h1:26379,h2:26380/0",
    ):
        assert read_settings({}, url).url == url


def test_a_publish_to_a_store_url_with_a_bad_port_is_one_config_error() -> None:
    app = Celery("input_port", set_as_current=False, broker="memory://")
    app.conf.baton_url = "redis://127.0.0.1:notaport/1"
    Baton(app)

    @app.task(exclusive="x", shared=False)
    def job(x: int) -> None: ...

    with pytest.raises(ConfigError, match=r"baton_url: .*port must be a number"):
        job.delay(1)


def test_every_misspelt_setting_is_reported_at_once() -> None:
    conf = {"baton_uri": "redis://127.0.0.1/0", "baton_lease_tl": 5, "baton_hold_mx": 3}
    with pytest.raises(ConfigError) as error:
        read_settings(conf)
    message = str(error.value)
    for typo, meant in (
        ("baton_uri", "baton_url"),
        ("baton_lease_tl", "baton_lease_ttl"),
        ("baton_hold_mx", "baton_hold_max"),
    ):
        assert f"`{typo}` (did you mean `{meant}`?)" in message, message


def test_every_misspelt_task_option_is_reported_at_once(app: Celery) -> None:
    with pytest.raises(ConfigError) as error:

        @app.task(
            exclusiv="feed_url", exclusive_conflit="wait", global_rate_limt="5/s", shared=False
        )
        def import_feed(feed_url: str) -> None: ...

    message = str(error.value)
    for meant in ("exclusive", "exclusive_conflict", "global_rate_limit"):
        assert f"did you mean `{meant}`" in message, message


# -- §7: another extension's options are not typos of ours ------------------------------


def test_celery_singleton_options_are_left_to_celery_singleton(app: Celery) -> None:
    singleton = pytest.importorskip("celery_singleton", reason="pip install celery-singleton")

    @app.task(base=singleton.Singleton, unique_on=["feed_url"], lock_expiry=60, shared=False)
    def import_feed(feed_url: str) -> None: ...

    @app.task(base=singleton.Singleton, unique_on=["feed_url"], exclusive="feed_url", shared=False)
    def import_other(feed_url: str) -> None: ...

    assert import_feed.unique_on == ["feed_url"]
    assert import_other.exclusive == "feed_url"


def test_celery_once_options_are_left_to_celery_once(app: Celery) -> None:
    once = pytest.importorskip("celery_once", reason="pip install celery_once")

    @app.task(base=once.QueueOnce, once={"keys": ["report_id"], "graceful": True}, shared=False)
    def build_report(report_id: int) -> None: ...

    assert build_report.once == {"keys": ["report_id"], "graceful": True}


def test_an_extension_option_on_its_class_as_app_task_is_not_ours() -> None:
    """``app.Task`` set to another extension's class: its options are its own even
    where ``base=`` is not written."""
    singleton = pytest.importorskip("celery_singleton", reason="pip install celery-singleton")
    app = Celery("input", task_cls=singleton.Singleton, set_as_current=False)
    Baton(app, url="redis://127.0.0.1:1/0")

    @app.task(unique_on=["feed_url"], shared=False)
    def import_feed(feed_url: str) -> None: ...


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"once": {"keys": ["report_id"]}}, "`once` is celery-once's option"),
        ({"unique_on": ["report_id"], "lock_expiry": 60}, "without base=Singleton"),
    ],
    ids=["once", "singleton"],
)
def test_an_extension_option_left_without_its_base_is_refused(
    app: Celery, options: dict[str, Any], words: str
) -> None:
    """A migration that removed ``base=QueueOnce`` and kept ``once=`` (or forgot to add
    ``unique=``): the option did nothing, and the task was queued twice without a word."""
    pytest.importorskip("celery_once", reason="pip install celery_once")
    pytest.importorskip("celery_singleton", reason="pip install celery-singleton")
    with pytest.raises(ConfigError, match=f"build_report: .*{words}.*celery-baton's is unique="):

        @app.task(shared=False, **options)
        def build_report(report_id: int) -> None: ...


def test_unique_on_left_behind_is_named_celery_singletons_not_a_typo(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A migrated module that no longer imports celery_singleton but kept ``unique_on=``:
    the error names celery-singleton and our option, not "did you mean `unique`?"."""
    monkeypatch.delitem(sys.modules, "celery_singleton", raising=False)
    with pytest.raises(ConfigError) as error:

        @app.task(unique_on=["report_id"], shared=False)
        def build_report(report_id: int) -> None: ...

    message = str(error.value)
    assert "`unique_on` is celery-singleton's option" in message, message
    assert "did you mean" not in message, message


def test_an_option_of_the_tasks_own_base_class_is_not_a_typo(app: Celery) -> None:
    class Audited(app.Task):  # type: ignore[name-defined,misc]
        abstract = True
        uniqueness = "strict"  # close to `unique`, but the base class's own

    @app.task(base=Audited, uniqueness="loose", shared=False)
    def job(x: int) -> None: ...

    assert job.uniqueness == "loose"


def test_an_option_that_is_nobodys_is_still_refused(app: Celery) -> None:
    pytest.importorskip("celery_singleton", reason="pip install celery-singleton")
    with pytest.raises(ConfigError, match="did you mean `unique`"):

        @app.task(uniqe="feed_url", shared=False)
        def import_feed(feed_url: str) -> None: ...


# -- §8: per-call input is checked as a declaration is ----------------------------------


@pytest.fixture
def feed(app: Celery) -> Any:
    app.conf.task_always_eager = False
    app.conf.broker_url = "memory://"

    @app.task(exclusive="url", exclusive_conflict="wait", shared=False)
    def import_feed(url: str) -> None: ...

    @app.task(exclusive="url", shared=False)
    def import_skip(url: str) -> None: ...

    return import_feed, import_skip


def test_a_per_call_key_naming_an_argument_the_task_does_not_take_is_refused(
    feed: Any,
) -> None:
    import_feed, _ = feed
    for name in ("exclusive", "unique"):
        with pytest.raises(ConfigError, match="'urll', which the function does not take"):
            import_feed.apply_async(("x",), baton={name: {"urll": "x"}})


def test_wait_timeout_where_nothing_waits_is_refused_per_call(feed: Any) -> None:
    import_feed, import_skip = feed
    with pytest.raises(ConfigError, match='wait_timeout does nothing with conflict="skip"'):
        import_feed.apply_async(("x",), baton={"conflict": "skip", "wait_timeout": 5})
    with pytest.raises(ConfigError, match="wait_timeout does nothing"):
        import_skip.apply_async(("x",), baton={"wait_timeout": 5})  # declared skip


@pytest.mark.parametrize("option", ["wait_timeout", "lease_ttl", "unique_ttl"])
def test_an_infinite_per_call_duration_is_refused(feed: Any, option: str) -> None:
    import_feed, _ = feed
    extra = {"unique": "x"} if option == "unique_ttl" else {}
    with pytest.raises(ConfigError, match=f"{option} must be seconds > 0 and finite"):
        import_feed.apply_async(("x",), baton={option: math.inf, **extra})


def test_a_declared_wait_timeout_where_nothing_waits_is_refused(app: Celery) -> None:
    for conflict in ({}, {"exclusive_conflict": "skip"}):
        with pytest.raises(ConfigError, match="exclusive_wait_timeout does nothing"):

            @app.task(exclusive="url", exclusive_wait_timeout=5, **conflict, shared=False)
            def import_feed(url: str) -> None: ...


def test_a_declared_infinite_wait_timeout_is_refused(app: Celery) -> None:
    with pytest.raises(ConfigError, match="> 0 and finite"):

        @app.task(
            exclusive="url",
            exclusive_conflict="wait",
            exclusive_wait_timeout=math.inf,
            shared=False,
        )
        def import_feed(url: str) -> None: ...


def test_every_documented_error_is_importable_from_the_package() -> None:
    import celery_baton

    for name in ("CostError", "LimitTimeout", "TaskSuperseded", "TaskSkipped"):
        assert issubclass(getattr(celery_baton, name), celery_baton.BatonError), name


def test_every_misspelt_per_call_option_is_reported_at_once(feed: Any) -> None:
    import_feed, _ = feed
    with pytest.raises(ConfigError) as error:
        import_feed.apply_async(("x",), baton={"exclusiv": "k", "conflit": "wait"})
    message = str(error.value)
    assert "did you mean `exclusive`" in message and "did you mean `conflict`" in message


def test_celery_once_per_call_option_left_on_a_call_is_refused(feed: Any) -> None:
    """``apply_async(..., once={"graceful": False})`` kept after the task lost
    ``base=QueueOnce``: Celery carried the option along unread, so the call that raised
    ``AlreadyQueued`` queued a duplicate without a word."""
    import_feed, _ = feed
    with pytest.raises(ConfigError, match=r"import_feed: apply_async\(once=...\).*baton=\{"):
        import_feed.apply_async(("x",), once={"graceful": False})


def test_celery_once_per_call_option_on_a_queue_once_task_is_left_to_it(app: Celery) -> None:
    once = pytest.importorskip("celery_once", reason="pip install celery_once")

    @app.task(base=once.QueueOnce, once={"keys": ["url"]}, shared=False)
    def import_feed(url: str) -> None: ...

    parts = installed_parts(app)
    assert parts is not None
    _refuse_orphan_once(parts, import_feed.name)  # QueueOnce reads it: not refused
    _refuse_orphan_once(parts, "another.apps.task")  # not this app's: unknown, left alone
