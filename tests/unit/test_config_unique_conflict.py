"""``baton_unique_conflict``: the default ``unique_conflict`` of every unique task, as
celery-singleton's ``singleton_raise_on_duplicate`` is for its tasks (issue 39 §3)."""

from __future__ import annotations

import pytest
from celery import Celery

from celery_baton import Baton, ConfigError
from celery_baton.config import UNIQUE_CONFLICT_DEFAULTS, read_settings
from celery_baton.core.policy.options import UNIQUE_CONFLICTS


def _app(**conf: object) -> tuple[Celery, Baton]:
    app = Celery("uc", set_as_current=False)
    app.conf.update(conf)
    return app, Baton(app, url="redis://127.0.0.1:1/0")  # never connected


def test_the_setting_is_every_unique_tasks_default_and_a_task_option_wins() -> None:
    app, baton = _app(baton_unique_conflict="raise")

    @app.task(shared=False, unique="report_id")
    def build_report(report_id: int) -> None: ...

    @app.task(shared=False, unique="report_id", unique_conflict="return")
    def build_once(report_id: int) -> None: ...

    assert baton.policy_for(build_report).unique_conflict == "raise"  # type: ignore[union-attr]
    assert baton.policy_for(build_once).unique_conflict == "return"  # type: ignore[union-attr]


def test_without_it_a_duplicate_returns_the_first_result() -> None:
    app, baton = _app()

    @app.task(shared=False, unique="report_id")
    def build_report(report_id: int) -> None: ...

    assert baton.policy_for(build_report).unique_conflict == "return"  # type: ignore[union-attr]


def test_a_bad_value_is_refused_naming_the_setting() -> None:
    with pytest.raises(ConfigError, match=r"baton_unique_conflict: .*'rase'.*did you mean"):
        read_settings({"baton_unique_conflict": "rase"})


def test_the_setting_takes_the_values_of_the_task_option() -> None:
    assert UNIQUE_CONFLICT_DEFAULTS == UNIQUE_CONFLICTS


def test_a_callable_key_reads_the_call_when_asked_of_the_module_level_task() -> None:
    """``baton.policy_for(g)`` with ``g`` the module's name for the task (Celery's proxy
    of it): a callable key was read from the proxy, bound to the task behind it, and
    failed with ``<lambda>() takes 1 positional argument but 2 were given``."""
    app = Celery("proxied", set_as_current=False)
    baton = Baton(app, url="redis://127.0.0.1:1/0")  # never connected

    @app.task(bind=True, unique=lambda feed_url: feed_url.lower())
    def fetch(self: object, feed_url: str) -> str:
        return feed_url

    app.finalize()
    policy = baton.policy_for(fetch)
    assert policy is not None and policy.unique is not None
    assert policy.unique.material(("HTTP://A",), {}) == "http://a"
