"""An app's parts: the only place that turns an app into settings, a store and policies.

Every part of celery-baton (the worker, the publish side, beat, the schedule API, the
CLI, metrics) asks :func:`parts_for` for an app's :class:`AppParts` and is handed them
down; nothing below ``Baton`` imports it. So no two of them can disagree about where
the store is, or about a task's policy. Before this, beat read ``app.conf`` alone and
ignored ``Baton(app, url=...)``: each machine's beat started its own embedded store,
became leader there, and every tick fired once per machine.

Settings are resolved on first use, not when ``Baton(app)`` is built, so ``app.conf``
may still be changed after it (Django reads its settings late). Celery-free: ``app``
is anything with a ``conf`` mapping.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

from celery_baton.config import Settings, read_settings
from celery_baton.core.batch import Batches
from celery_baton.core.cancels import Cancels
from celery_baton.core.debounce import Debounces
from celery_baton.core.gate import Gate
from celery_baton.core.keys import KeyNames
from celery_baton.core.ordered import OrderedStamps
from celery_baton.core.policy.compile import compile_policy
from celery_baton.core.policy.model import TaskPolicy
from celery_baton.core.supersede import Supersede
from celery_baton.core.unique import UniqueClaims
from celery_baton.errors import ConfigError
from celery_baton.store.connection import Store, connect, redact_url

logger = logging.getLogger("celery_baton")


def task_option(task: Any, option: str) -> Any:
    """A task option as declared. A function given as an option (``cost=lambda ...``,
    a callable key spec) is a class attribute of the task, so reading it from the task
    binds it: the task would come first, before the call's own arguments."""
    value = getattr(task, option, None)
    if inspect.ismethod(value):
        # The task as the module holds it may be Celery's proxy of it: the method is
        # bound to the task behind it.
        unproxied = getattr(task, "_get_current_object", None)
        if value.__self__ is task or (callable(unproxied) and value.__self__ is unproxied()):
            return value.__func__
    return value


class AppParts:
    """An app's resolved settings and the parts built from them, each built once."""

    def __init__(self, app: Any, url: str | None = None) -> None:
        self._app = weakref.ref(app)
        self._conf = app.conf
        self.url_given = url  # Baton(app, url=...): wins over every setting
        # The Baton that installed its hooks on the app (None: never installed), for
        # ``baton_for``. Celery builds the consumer bootstep itself, from the app alone:
        # ``installed`` is how it knows to run. Nothing below Baton reads the object.
        self.installed_by: object | None = None
        self._policies: dict[str, TaskPolicy | None] = {}
        self._policy_lock = threading.Lock()
        #: Set by ``Baton(app)``: refuses a registered task's misspelt option names (which
        #: compiling its policy cannot see: an unknown attribute is not read).
        self.check_option_names: Callable[[Any], None] | None = None

    @property
    def app(self) -> Any:
        app = self._app()
        if app is None:  # pragma: no cover - parts live no longer than their app's users
            raise ConfigError("the app of these parts is gone", subject="parts_for")
        return app

    @property
    def installed(self) -> bool:
        """Whether ``Baton(app)`` installed celery-baton on the app."""
        return self.installed_by is not None

    @functools.cached_property
    def settings(self) -> Settings:
        settings = read_settings(self._conf, self.url_given)
        if settings.url_source == "broker_url" and settings.url:
            # Said once per process: the store was chosen, not named.
            logger.info(
                "celery-baton: no store URL is set (baton_url / $BATON_URL): the store is "
                "the broker's Redis (%s)",
                redact_url(settings.url),
            )
        return settings

    @functools.cached_property
    def names(self) -> KeyNames:
        return KeyNames(self.settings.key_prefix)

    @functools.cached_property
    def store(self) -> Store:
        """This process's shared connection to the store."""
        return self.connect(client_name="celery-baton")

    @functools.cached_property
    def gate(self) -> Gate:
        return Gate(
            self.store,
            notice_channel=self.names.notice_channel,
            grace_key=self.names.store_epoch,
        )

    @functools.cached_property
    def unique(self) -> UniqueClaims:
        return UniqueClaims(self.store)

    @functools.cached_property
    def supersede(self) -> Supersede:
        return Supersede(self.store, self.names)

    @functools.cached_property
    def ordered(self) -> OrderedStamps:
        return OrderedStamps(self.store, self.names)

    @functools.cached_property
    def cancels(self) -> Cancels:
        return Cancels(self.store, self.names)

    @functools.cached_property
    def debounces(self) -> Debounces:
        return Debounces(self.store, self.names)

    @functools.cached_property
    def batches(self) -> Batches:
        return Batches(self.store, self.names)

    def connect(
        self,
        *,
        socket_timeout: float | None = None,
        client_name: str | None = None,
        start_embedded: bool = True,
    ) -> Store:
        """A connection of its own to the same store (beat wants a shorter timeout; an
        operator's command must not start an embedded server)."""
        settings = self.settings
        return connect(
            settings.url,
            socket_timeout=settings.socket_timeout if socket_timeout is None else socket_timeout,
            client_name=client_name,
            start_embedded=start_embedded,
        )

    @property
    def resolved(self) -> bool:
        return "settings" in self.__dict__

    # -- the worker's timings ---------------------------------------------------------

    @property
    def renew_interval(self) -> float:
        ttls = [p.lease_ttl for p in self._policies.values() if p is not None]
        return min([self.settings.lease_ttl, *ttls]) / 3

    def on_lease_lost(self, owner: str, key: str) -> None:
        logger.error(
            "a running task lost its lease %s (owner %s): another run may have "
            "started; use fence() to refuse its late writes",
            key,
            owner,
        )

    # -- policies ---------------------------------------------------------------------

    def policy_for(self, task: Any) -> TaskPolicy | None:
        """The task's compiled policy (None: it declares no celery-baton option)."""
        name = task.name
        try:
            return self._policies[name]
        except KeyError:
            pass
        with self._policy_lock:
            if name not in self._policies:
                # Its option names too, as the worker's start does: a ``@shared_task``
                # is not made through the ``app.task`` Baton(app) wraps, so its
                # ``uniqe=`` went unseen in a publishing process, which queued
                # duplicates without a word (only the worker refused to start).
                if self.check_option_names is not None:
                    self.check_option_names(task)
                self._policies[name] = compile_policy(
                    name, functools.partial(task_option, task), task.run, self.settings
                )
            return self._policies[name]

    def policy_for_name(self, name: str) -> TaskPolicy | None:
        task = self.app.tasks.get(name)
        return None if task is None else self.policy_for(task)

    def validate_all_tasks(self) -> None:
        """Check every registered task's options and compile its policy: a bad option
        stops the worker at start, whenever and however the task was declared."""
        for task in list(self.app.tasks.values()):
            if self.check_option_names is not None:
                self.check_option_names(task)
            self.policy_for(task)


_parts: weakref.WeakKeyDictionary[Any, AppParts] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def installed_parts(app: Any) -> AppParts | None:
    """The parts of ``app`` if ``Baton(app)`` installed celery-baton on it, else None."""
    with _lock:
        parts = _parts.get(app)
    return parts if parts is not None and parts.installed else None


def parts_for(app: Any, *, url: str | None = None) -> AppParts:
    """The parts of ``app``; ``url`` (from ``Baton(app, url=...)``) is recorded once.

    A URL given after the settings were already resolved without it would leave two
    parts of one process on two stores: that is an error, not a silent choice.
    """
    with _lock:
        parts = _parts.get(app)
        if parts is None:
            parts = _parts[app] = AppParts(app, url)
        elif url is not None and url != parts.url_given:
            if parts.resolved and parts.settings.url != url:
                raise ConfigError(
                    f"the store of app {getattr(app, 'main', app)!r} was already resolved to "
                    f"{redact_url(parts.settings.url or 'embedded://')}; create "
                    "Baton(app, url=...) before anything uses celery-baton",
                    subject="Baton(url=)",
                )
            parts.url_given = url
        return parts


__all__ = ["AppParts", "installed_parts", "parts_for", "task_option"]
