"""pytest plugin: celery-baton installed in every app Celery's own test fixtures build.

Loaded by ``tests/celery_suite/run.py`` as ``-p celery_baton_suite_plugin`` into a run of
Celery's ``t/integration`` (from the sdist of the Celery version installed). Celery's
fixtures (``celery.contrib.pytest``: ``celery_session_app`` for the worker,
``celery_app`` for each test's publishes) build their apps with
``celery.contrib.testing.app.TestApp``; this plugin wraps that factory, so each app gets
``Baton(app)`` right after it is created, as a user installs it: one line, nothing of
the suite changed. ``CELERY_BATON_SUITE`` says how:

* ``plain`` -- nothing installed (the run every other is compared with);
* ``defaults`` -- ``Baton(app)`` with the defaults;
* ``guard`` -- also ``baton_redelivery_guard = True`` and ``baton_global_rate_limits =
  True``.

The store is ``$BATON_URL`` (celery-baton's own fallback), a server of its own, so
that nothing of celery-baton's shows in the broker's keys or its pub/sub channels,
which some of Celery's tests count.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

#: Celery's fixtures, unless another plugin (pytest-celery) registered them already.
pytest_plugins = ["celery.contrib.pytest"]

MODES = ("plain", "defaults", "guard")
SETTINGS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "guard": {"baton_redelivery_guard": True, "baton_global_rate_limits": True},
}


def mode() -> str:
    value = os.environ.get("CELERY_BATON_SUITE", "plain")
    if value not in MODES:
        raise pytest.UsageError(f"CELERY_BATON_SUITE must be one of {MODES}, got {value!r}")
    return value


def pytest_configure(config: pytest.Config) -> None:
    chosen = mode()
    if chosen == "plain":
        return
    from celery.contrib.testing import app as testing_app

    from celery_baton import Baton

    build = testing_app.TestApp
    if getattr(build, "_baton_wrapped", False):
        return

    def test_app_with_baton(*args: Any, **kwargs: Any) -> Any:
        app = build(*args, **kwargs)
        app.conf.update(SETTINGS[chosen])
        Baton(app)
        return app

    test_app_with_baton._baton_wrapped = True  # type: ignore[attr-defined]
    testing_app.TestApp = test_app_with_baton


def pytest_report_header(config: pytest.Config) -> str:
    return f"celery-baton suite mode: {mode()} {SETTINGS.get(mode(), '')}"
