"""``Baton(app)`` made after the tasks are declared checks them as a declaration does
(issue 39 §2): a typo or a bad option is refused when ``Baton(app)`` is made, with the
same error as when it comes first, never accepted in silence."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from celery_baton import Baton, ConfigError


@pytest.fixture(autouse=True)
def no_shared_tasks_of_other_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each app here holds its own tasks only. A ``shared_task`` (Celery's default for
    ``app.task``) of a test app imported earlier in this process joins every app
    finalized after it, with options meant for its own app: an app of this module that
    met one (a ``limits=`` its ``baton_limits`` lacks) failed on it, not on its own."""
    import celery._state

    monkeypatch.setattr(celery._state, "_on_app_finalizers", set())


URL = "redis://127.0.0.1:1/0"  # never connected by these tests


@pytest.mark.parametrize("finalized", [False, True], ids=["pending", "finalized"])
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"exclusiv": "feed_url"}, "did you mean `exclusive`"),
        ({"exclusive": "missing"}, "missing"),
        ({"global_rate_limit": "5/x"}, "global_rate_limit"),
        ({"exclusive_conflict": "wait"}, "needs exclusive"),
    ],
)
def test_baton_made_after_a_bad_declaration_refuses_it(
    options: dict[str, Any], message: str, finalized: bool
) -> None:
    app = Celery("late", set_as_current=False)

    @app.task(shared=False, **options)
    def import_feed(feed_url: str) -> None: ...

    if finalized:
        app.finalize()
    with pytest.raises(ConfigError, match=message) as error:
        Baton(app, url=URL)
    assert "import_feed" in str(error.value)


def test_the_same_error_as_when_baton_comes_first() -> None:
    first = Celery("first", set_as_current=False)
    Baton(first, url=URL)
    with pytest.raises(ConfigError) as before:

        @first.task(shared=False, exclusiv="feed_url")
        def import_feed(feed_url: str) -> None: ...

    late = Celery("first", set_as_current=False)

    @late.task(shared=False, exclusiv="feed_url")  # type: ignore[misc]
    def import_feed(feed_url: str) -> None: ...

    with pytest.raises(ConfigError) as after:
        Baton(late, url=URL)
    assert str(after.value) == str(before.value)


def test_good_declarations_before_baton_are_accepted_and_guarded() -> None:
    app = Celery("late_ok", set_as_current=False)

    @app.task(shared=False, exclusive="feed_url", queue="feeds")
    def import_feed(feed_url: str) -> None: ...

    @app.task(shared=False)
    def plain() -> None: ...

    baton = Baton(app, url=URL)
    assert not app.finalized  # Baton(app) does not finalize the app
    assert baton.policy_for(app.tasks[import_feed.name]) is not None


def test_a_worker_start_checks_tasks_declared_around_baton() -> None:
    """A task declared with a decorator taken before ``Baton(app)`` (``task =
    app.task``) is not seen by it: every task's option names are checked again when
    every task is validated (at worker start and in the CLI)."""
    app = Celery("late_decorator", set_as_current=False)
    task = app.task  # taken before Baton(app) wraps it
    baton = Baton(app, url=URL)

    @task(shared=False, exclusiv="feed_url")
    def import_feed(feed_url: str) -> None: ...

    with pytest.raises(ConfigError, match="did you mean `exclusive`"):
        baton.validate_all_tasks()


def test_a_class_based_tasks_own_attributes_are_its_authors() -> None:
    from celery import Task

    app = Celery("late_class", set_as_current=False)
    baton = Baton(app, url=URL)

    class Report(Task):  # type: ignore[misc]
        name = "report"
        limit = 10  # the author's own, near `limits`: not taken for a typo

        def run(self) -> None: ...

    app.register_task(Report())
    baton.validate_all_tasks()
