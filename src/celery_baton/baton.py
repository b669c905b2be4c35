"""``Baton(app)``: installs celery-baton on a Celery app."""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

from celery import Celery
from celery import Task as CeleryTask
from celery import signals as celery_signals

from celery_baton.config import Settings
from celery_baton.debounce import Debounces
from celery_baton.errors import BatonError
from celery_baton.gate import Gate
from celery_baton.keys import KeyNames
from celery_baton.policy import (
    TASK_OPTIONS,
    TaskPolicy,
    check_option_names,
    compile_policy,
    declares_options,
)
from celery_baton.publish import guard_send_task
from celery_baton.shared_limits import NamedLimit, parse_limits, resolve
from celery_baton.store.connection import Store
from celery_baton.unique import UniqueClaims
from celery_baton.wiring import parts_for

logger = logging.getLogger("celery_baton")

_batons: weakref.WeakKeyDictionary[Any, Baton] = weakref.WeakKeyDictionary()

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


def _name_of(fun: Callable[..., Any], options: dict[str, Any]) -> str:
    return str(options.get("name") or f"{fun.__module__}.{fun.__qualname__}")


def _checked_later(decorate: Callable[..., Any], options: dict[str, Any]) -> Callable[..., Any]:
    """``@app.task(exclusiv=...)``: the function is known only when the decorator runs."""

    def decorator(fun: Callable[..., Any]) -> Any:
        check_option_names(_name_of(fun, options), options, CELERY_NAMES)
        return decorate(fun)

    return decorator


def _task_option(task: Any, option: str) -> Any:
    """A task option as declared. A function given as an option (``cost=lambda ...``,
    a callable key spec) is a class attribute of the task, so reading it from the task
    binds it: the task would come first, before the call's own arguments."""
    value = getattr(task, option, None)
    if inspect.ismethod(value) and value.__self__ is task:
        return value.__func__
    return value


def baton_for(app: Any) -> Baton | None:
    """The Baton installed on ``app``, if any."""
    return _batons.get(app)


def _warn_if_not_installed(sender: Any = None, **kwargs: Any) -> None:
    """A worker of an app whose tasks declare celery-baton options but that never called
    ``Baton(app)``: those options do nothing (``unique`` would be a silent no-op)."""
    app = getattr(sender, "app", None)
    if app is None or app in _batons:
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
        if app in _batons:
            raise BatonError(f"celery-baton is already installed on app {app.main!r}")
        self.app = app
        self.parts = parts_for(app, url=url)
        self.parts.installed = self
        self._policies: dict[str, TaskPolicy | None] = {}
        self._lock = threading.Lock()
        _batons[app] = self
        from celery_baton.worker import run_end
        from celery_baton.worker.step import BatonConsumer

        app.steps["consumer"].add(BatonConsumer)
        run_end.install()
        app.send_task = guard_send_task(self, app.send_task)
        app.task = self._validating_task_decorator(app.task)

    # -- lazily built parts -----------------------------------------------------------

    # Resolved in one place for the whole app (celery_baton.wiring): beat, the schedule
    # API, the CLI and metrics read the very same settings and store.

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
    def hold_horizon(self) -> float:
        """How long a request may be held: below the broker's visibility timeout."""
        options = self.app.conf.broker_transport_options or {}
        visibility = options.get("visibility_timeout")
        horizon = self.settings.hold_horizon
        if visibility:
            horizon = min(horizon, float(visibility) / 2)
        return horizon

    @property
    def renew_interval(self) -> float:
        ttls = [p.lease_ttl for p in self._policies.values() if p is not None]
        return min([self.settings.lease_ttl, *ttls]) / 3

    # -- policies ---------------------------------------------------------------------

    def policy_for(self, task: Any) -> TaskPolicy | None:
        name = task.name
        try:
            return self._policies[name]
        except KeyError:
            pass
        with self._lock:
            if name not in self._policies:
                self._policies[name] = compile_policy(
                    name, functools.partial(_task_option, task), task.run, self.settings
                )
            return self._policies[name]

    def policy_for_name(self, name: str) -> TaskPolicy | None:
        task = self.app.tasks.get(name)
        return None if task is None else self.policy_for(task)

    def validate_all_tasks(self) -> None:
        """Compile every registered task's policy: a bad option stops the worker at start."""
        for task in list(self.app.tasks.values()):
            self.policy_for(task)

    def _validating_task_decorator(self, task_decorator: Callable[..., Any]) -> Callable[..., Any]:
        """``@app.task(exclusive="missing")`` raises at declaration, not at 3 a.m."""

        @functools.wraps(task_decorator)
        def task(*args: Any, **options: Any) -> Any:
            if len(args) == 1 and callable(args[0]):
                check_option_names(_name_of(args[0], options), options, CELERY_NAMES)
            if not declares_options(options):
                if options and not (len(args) == 1 and callable(args[0])):
                    return _checked_later(task_decorator(*args, **options), options)
                return task_decorator(*args, **options)

            def validate(fun: Callable[..., Any]) -> None:
                name = _name_of(fun, options)
                check_option_names(name, options, CELERY_NAMES)
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
        logger.error(
            "a running task lost its lease %s (owner %s): another run may have "
            "started; use fence() to refuse its late writes",
            key,
            owner,
        )


__all__ = ["TASK_OPTIONS", "Baton", "baton_for"]
