"""A beat name guessed at the package's top level points at where it is. No server."""

from __future__ import annotations

import pytest
from celery import Celery
from celery.beat import Service

import celery_baton


@pytest.mark.parametrize("path", ["celery_baton.Scheduler", "celery_baton:Scheduler"])
def test_beat_dash_s_with_the_package_path_names_the_right_one(path: str) -> None:
    """``celery beat -S celery_baton.Scheduler``: Celery resolves the path with
    ``symbol_by_name``, whose AttributeError is what the user reads."""
    app = Celery("names", set_as_current=False)
    service = Service(app, scheduler_cls=path)
    with pytest.raises(AttributeError, match=r"celery_baton\.beat:Scheduler"):
        service.get_scheduler(lazy=True)


def test_schedule_store_from_the_package_names_its_module() -> None:
    with pytest.raises(AttributeError, match=r"from celery_baton\.beat import ScheduleStore"):
        celery_baton.ScheduleStore  # noqa: B018


def test_an_unknown_name_is_a_plain_attribute_error() -> None:
    with pytest.raises(AttributeError, match=r"^module 'celery_baton' has no attribute 'nope'$"):
        celery_baton.nope  # type: ignore[attr-defined]  # noqa: B018
    assert not hasattr(celery_baton, "__path_hook__")  # hasattr still answers False
