"""A bad declaration stops the ``celery`` command with its one line, not Celery's
traceback (issue 39 §5).

``@app.task(exclusiv=...)`` raises ConfigError while the app module is imported. The
``celery`` command catches every error of ``-A``'s import and prints its whole
traceback (68-78 lines through importlib, Celery and the decorator) with the one line
that says what is wrong last. The ``celery`` command loads its plugins (this package's
``baton`` group) before ``-A``: loading ours wraps the ``find_app`` it calls, so a
celery-baton ConfigError is printed alone and the command exits 1, whatever the
sub-command (worker, beat, baton ...). Any other error keeps Celery's report.

A task declared in a module of ``include=`` (or ``imports``, ``autodiscover_tasks()``)
is imported later, by the worker and beat at start (the loader's
``import_default_modules``): the app that ``find_app`` returns has that call wrapped
the same way.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

from celery_baton import internals
from celery_baton.errors import ConfigError


def one_line(exc: ConfigError) -> str:
    return f"celery_baton.errors.{type(exc).__name__}: {exc}"


def _refusing_in_one_line(load: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(load)
    def load_or_one_line(*args: Any, **kwargs: Any) -> Any:
        try:
            return load(*args, **kwargs)
        except ConfigError as exc:
            # SystemExit: Celery's `except Exception` around find_app would print the
            # traceback this replaces.
            print(one_line(exc), file=sys.stderr, flush=True)
            raise SystemExit(1) from None

    load_or_one_line.baton_one_line = True  # type: ignore[attr-defined]
    return load_or_one_line


def _finding_app_in_one_line(find_app: Callable[..., Any]) -> Callable[..., Any]:
    find = _refusing_in_one_line(find_app)

    @functools.wraps(find_app)
    def find_app_or_one_line(*args: Any, **kwargs: Any) -> Any:
        app = find(*args, **kwargs)
        loader = getattr(app, "loader", None)
        imports = getattr(loader, "import_default_modules", None)
        if imports is not None and not getattr(imports, "baton_one_line", False):
            loader.import_default_modules = _refusing_in_one_line(imports)  # type: ignore[union-attr]
        return app

    find_app_or_one_line.baton_one_line = True  # type: ignore[attr-defined]
    return find_app_or_one_line


def install() -> None:
    """Wrap the ``celery`` command's ``find_app`` once (a no-op outside that command)."""
    module = internals.cli_app_loader()
    if module is None or getattr(module.find_app, "baton_one_line", False):
        return
    module.find_app = _finding_app_in_one_line(module.find_app)


__all__ = ["install", "one_line"]
