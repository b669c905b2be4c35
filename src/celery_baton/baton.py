"""``Baton(app)``: installs celery-baton on a Celery app."""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from typing import Any

from celery import Celery
from celery import Task as CeleryTask
from celery import signals as celery_signals

from celery_baton.config import Settings
from celery_baton.core.debounce import Debounces
from celery_baton.core.gate import Gate
from celery_baton.core.keys import KeyNames
from celery_baton.core.policy.compile import compile_policy
from celery_baton.core.policy.model import TaskPolicy
from celery_baton.core.policy.options import TASK_OPTIONS, check_option_names, declares_options
from celery_baton.core.shared_limits import NamedLimit, parse_limits, resolve
from celery_baton.core.unique import UniqueClaims
from celery_baton.errors import BatonError
from celery_baton.parts import AppParts, installed_parts, parts_for
from celery_baton.publish import guard_send_task
from celery_baton.store.connection import Store
from celery_baton.worker.pool import run_end
from celery_baton.worker.step import BatonConsumer

logger = logging.getLogger("celery_baton")

#: Names that are Celery's, not ours: a task option among them is never a typo of ours.
CELERY_NAMES = frozenset(
    [name for name in dir(CeleryTask) if not name.startswith("_")]
    + [
        "name", "base", "bind", "shared", "queue", "routing_key", "exchange", "priority",
        "expires", "countdown", "eta", "serializer", "compression", "autoretry_for",
        "retry_kwargs", "retry_backoff", "retry_backoff_max", "retry_jitter", "pydantic",
        "dont_autoretry_for", "filter", "lazy",
    ]
)  # fmt: skip


#: Other extensions' task classes, by module: their attributes are their options
#: (celery-singleton's ``unique_on``, celery-once's ``once``), never a typo of ours, even
#: on a task that does not name that class as its base (``app.Task`` may be set to it).
#: Read only when the user's code imported that module.
EXTENSION_TASKS = {"celery_singleton": "Singleton", "celery_once": "QueueOnce"}


def others_names(options: dict[str, Any], app_task: Any) -> frozenset[str]:
    """The names a task declaration may use that are not ours: Celery's, the attributes
    of the task's base class (``base=`` or the app's Task class, where another extension
    declares its options) and those of the installed extensions' task classes."""
    names = set(CELERY_NAMES)
    bases = [options.get("base"), app_task]
    for module, attr in EXTENSION_TASKS.items():
        if module in sys.modules:
            bases.append(getattr(sys.modules[module], attr, None))
    for base in bases:
        if isinstance(base, type):
            names.update(n for n in dir(base) if not n.startswith("_"))
    return frozenset(names)


def _name_of(fun: Callable[..., Any], options: dict[str, Any]) -> str:
    return str(options.get("name") or f"{fun.__module__}.{fun.__qualname__}")


def _checked_later(
    decorate: Callable[..., Any], options: dict[str, Any], others: frozenset[str]
) -> Callable[..., Any]:
    """``@app.task(exclusiv=...)``: the function is known only when the decorator runs."""

    def decorator(fun: Callable[..., Any]) -> Any:
        check_option_names(_name_of(fun, options), options, others)
        return decorate(fun)

    return decorator


def baton_for(app: Any) -> Baton | None:
    """The Baton installed on ``app``, if any."""
    parts = installed_parts(app)
    baton = None if parts is None else parts.installed_by
    return baton if isinstance(baton, Baton) else None


def _warn_if_not_installed(sender: Any = None, **kwargs: Any) -> None:
    """A worker of an app whose tasks declare celery-baton options but that never called
    ``Baton(app)``: those options do nothing (``unique`` would be a silent no-op)."""
    app = getattr(sender, "app", None)
    if app is None or installed_parts(app) is not None:
        return
    names = sorted(
        name
        for name, task in list(app.tasks.items())
        if any(getattr(task, option, None) is not None for option in TASK_OPTIONS)
    )
    if names:
        logger.warning(
            "tasks %s declare celery-baton options, but Baton(app) was never called for "
            "app %r: they run UNGUARDED. Call Baton(app) where the app is created.",
            ", ".join(names),
            app.main,
        )


celery_signals.worker_init.connect(_warn_if_not_installed, weak=False)


class Baton:
    """Coordination for one Celery app.

    >>> app = Celery("feeds", broker="redis://127.0.0.1:6379/0")
    >>> baton = Baton(app)          # store: url= > baton_url > $BATON_URL > embedded Valkey
    >>> @app.task(exclusive="feed_url")
    ... def import_feed(feed_url): ...

    The store is connected on first use, so ``app.conf`` may still be changed after
    ``Baton(app)``.
    """

    def __init__(self, app: Celery, *, url: str | None = None) -> None:
        if installed_parts(app) is not None:
            raise BatonError(f"celery-baton is already installed on app {app.main!r}")
        self.app = app
        self.parts: AppParts = parts_for(app, url=url)
        self.parts.installed_by = self
        # Celery builds the consumer bootstep from the app alone: it finds the parts
        # through parts_for(app).
        app.steps["consumer"].add(BatonConsumer)
        run_end.install()
        app.send_task = guard_send_task(self.parts, app.send_task)
        app.task = self._validating_task_decorator(app.task)

    # -- the app's parts (celery_baton.parts) -----------------------------------------

    # Resolved in one place for the whole app: the worker, beat, the schedule API, the
    # CLI and metrics are handed the very same settings, store and policies.

    @property
    def settings(self) -> Settings:
        return self.parts.settings

    @property
    def store(self) -> Store:
        return self.parts.store

    @property
    def names(self) -> KeyNames:
        return self.parts.names

    @property
    def gate(self) -> Gate:
        return self.parts.gate

    @property
    def renew_interval(self) -> float:
        return self.parts.renew_interval

    # -- policies ---------------------------------------------------------------------

    def policy_for(self, task: Any) -> TaskPolicy | None:
        return self.parts.policy_for(task)

    def policy_for_name(self, name: str) -> TaskPolicy | None:
        return self.parts.policy_for_name(name)

    def validate_all_tasks(self) -> None:
        """Compile every registered task's policy: a bad option stops the worker at start."""
        self.parts.validate_all_tasks()

    def _validating_task_decorator(self, task_decorator: Callable[..., Any]) -> Callable[..., Any]:
        """``@app.task(exclusive="missing")`` raises at declaration, not at 3 a.m."""

        @functools.wraps(task_decorator)
        def task(*args: Any, **options: Any) -> Any:
            others = others_names(options, self.app.Task) if options else CELERY_NAMES
            if len(args) == 1 and callable(args[0]):
                check_option_names(_name_of(args[0], options), options, others)
            if not declares_options(options):
                if options and not (len(args) == 1 and callable(args[0])):
                    return _checked_later(task_decorator(*args, **options), options, others)
                return task_decorator(*args, **options)

            def validate(fun: Callable[..., Any]) -> None:
                name = _name_of(fun, options)
                check_option_names(name, options, others)
                # Named limits are checked now when the app's conf already has them.
                conf = self.app.conf
                known = Settings(limits=conf.get("baton_limits", conf.get("BATON_LIMITS")))
                compile_policy(name, options.get, fun, known, bound=bool(options.get("bind")))

            if len(args) == 1 and callable(args[0]):
                validate(args[0])
                return task_decorator(*args, **options)
            decorate = task_decorator(*args, **options)

            def decorator(fun: Callable[..., Any]) -> Any:
                validate(fun)
                return decorate(fun)

            return decorator

        return task

    def limit(self, name: str, *, cost: float = 1, timeout: float | None = None) -> NamedLimit:
        """A named limit of ``baton_limits``, for code outside a task's admission::

            with baton.limit("openai", cost=tokens, timeout=30): ...
            baton.limit("openai").try_acquire(cost=tokens)
            baton.limit("openai").penalize(retry_after)

        ConfigError for a name ``baton_limits`` does not have (with a suggestion).
        """
        table = parse_limits(self.settings.limits)
        (limit,) = resolve(table, [name], subject=f"baton.limit({name!r})")
        limit.check_cost(cost, subject=f"baton.limit({name!r})")
        return NamedLimit(self.gate, self.names, limit, cost=cost, timeout=timeout)

    @property
    def unique(self) -> UniqueClaims:
        """Unique claims at publish time (the publish side's door to the store)."""
        return self.parts.unique

    @property
    def debounces(self) -> Debounces:
        """Debounce records at publish time (see debounce.py)."""
        return self.parts.debounces

    def on_lease_lost(self, owner: str, key: str) -> None:
        self.parts.on_lease_lost(owner, key)


__all__ = ["TASK_OPTIONS", "Baton", "baton_for"]
