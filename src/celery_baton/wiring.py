"""One app, one resolution: the only place that turns an app into settings and a store.

Every part of celery-baton (the worker, the publish side, beat, the schedule API, the
CLI, metrics) asks :func:`parts_for` for an app's settings and store, so no two of them
can disagree about where the store is. Before this, beat read ``app.conf`` alone and
ignored ``Baton(app, url=...)``: each machine's beat started its own embedded store,
became leader there, and every tick fired once per machine.

Settings are resolved on first use, not when ``Baton(app)`` is built, so ``app.conf``
may still be changed after it (Django reads its settings late). Celery-free: ``app``
is anything with a ``conf`` mapping.
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from typing import Any

from celery_baton.config import Settings, read_settings
from celery_baton.debounce import Debounces
from celery_baton.errors import ConfigError
from celery_baton.gate import Gate
from celery_baton.keys import KeyNames
from celery_baton.store.connection import Store, connect, redact_url
from celery_baton.supersede import Supersede
from celery_baton.unique import UniqueClaims

logger = logging.getLogger("celery_baton")


class AppParts:
    """An app's resolved settings and the parts built from them, each built once."""

    def __init__(self, app: Any, url: str | None = None) -> None:
        self._app = weakref.ref(app)
        self._conf = app.conf
        self.url_given = url  # Baton(app, url=...): wins over every setting
        # The Baton installed on the app (None: never installed). Celery builds the
        # consumer bootstep itself, from the app alone: this is how it finds its parts.
        self.installed: Any = None

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
    def debounces(self) -> Debounces:
        return Debounces(self.store, self.names)

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


_parts: weakref.WeakKeyDictionary[Any, AppParts] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


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


__all__ = ["AppParts", "parts_for"]
