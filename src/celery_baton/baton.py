"""``Baton(app)``: installs celery-baton on a Celery app."""

from __future__ import annotations

import functools
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from celery import Celery
from celery import signals as celery_signals

from celery_baton.config import Settings, read_settings
from celery_baton.errors import BatonError
from celery_baton.gate import Gate
from celery_baton.keys import KeyNames
from celery_baton.policy import TASK_OPTIONS, TaskPolicy, compile_policy, declares_options
from celery_baton.publish import guard_send_task
from celery_baton.store.connection import STORE_ERRORS, Store, connect
from celery_baton.store.scripts import Pending

logger = logging.getLogger("celery_baton")

_batons: weakref.WeakKeyDictionary[Any, Baton] = weakref.WeakKeyDictionary()


def baton_for(app: Any) -> Baton | None:
    """The Baton installed on ``app``, if any."""
    return _batons.get(app)


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
        self._url = url
        self._policies: dict[str, TaskPolicy | None] = {}
        self._lock = threading.Lock()
        self.admission: Any = None
        _batons[app] = self
        from celery_baton.worker.step import BatonConsumer

        app.steps["consumer"].add(BatonConsumer)
        app.send_task = guard_send_task(self, app.send_task)
        app.task = self._validating_task_decorator(app.task)
        celery_signals.task_revoked.connect(self._on_revoked, weak=False)

    # -- lazily built parts -----------------------------------------------------------

    @functools.cached_property
    def settings(self) -> Settings:
        return read_settings(self.app.conf, self._url)

    @functools.cached_property
    def store(self) -> Store:
        return connect(
            self.settings.url,
            socket_timeout=self.settings.socket_timeout,
            client_name="celery-baton",
        )

    @functools.cached_property
    def names(self) -> KeyNames:
        return KeyNames(self.settings.key_prefix)

    @functools.cached_property
    def gate(self) -> Gate:
        return Gate(self.store, notice_channel=self.names.notice_channel)

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
                    name, lambda option: getattr(task, option, None), task.run, self.settings
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
            if not declares_options(options):
                return task_decorator(*args, **options)

            def validate(fun: Callable[..., Any]) -> None:
                name = options.get("name") or f"{fun.__module__}.{fun.__qualname__}"
                compile_policy(name, options.get, fun, Settings(), bound=bool(options.get("bind")))

            if len(args) == 1 and callable(args[0]):
                validate(args[0])
                return task_decorator(*args, **options)
            decorate = task_decorator(*args, **options)

            def decorator(fun: Callable[..., Any]) -> Any:
                validate(fun)
                return decorate(fun)

            return decorator

        return task

    # -- unique keys ------------------------------------------------------------------

    def claim_unique(self, key: str, task_id: str, ttl: float) -> str:
        """Claim ``key`` for ``task_id``: '' when claimed, else the holder's task id."""
        return self.claim_result(self.send_claim(key, task_id, ttl), key, task_id, ttl)

    def send_claim(self, key: str, task_id: str, ttl: float) -> Pending:
        """Write the claim now; ``claim_result`` reads its answer (the round trip overlaps
        what the caller does meanwhile: building the message)."""
        try:
            return self.store.scripts.send("unique_claim", [key], [task_id, round(ttl * 1000)])
        except STORE_ERRORS as exc:
            self.release_unique_later(key, task_id, ttl)  # part of it may have been written
            raise self.store.unavailable(exc) from exc

    def claim_result(self, pending: Pending, key: str, task_id: str, ttl: float) -> str:
        try:
            holder = self.store.scripts.result(pending)
        except STORE_ERRORS as exc:
            # The claim may still run later (a paused store executes what it buffered):
            # give it back once the store answers, or it would block the key for ttl.
            self.release_unique_later(key, task_id, ttl)
            raise self.store.unavailable(exc) from exc
        return str(holder or "")

    def release_unique_later(self, key: str, task_id: str, ttl: float) -> None:
        def retry() -> None:
            deadline = time.monotonic() + ttl
            delay = 0.5
            while time.monotonic() < deadline:
                time.sleep(delay)
                try:
                    self.release_unique(key, task_id)
                    # Once more, in case the buffered claim ran after our first release.
                    time.sleep(delay)
                    self.release_unique(key, task_id)
                    return
                except BatonError:
                    delay = min(delay * 2, 10.0)

        threading.Thread(target=retry, name="baton-unclaim", daemon=True).start()

    def release_unique(self, key: str, task_id: str) -> bool:
        try:
            return bool(self.store.scripts.run("unique_release", [key], [task_id]))
        except STORE_ERRORS as exc:
            raise self.store.unavailable(exc) from exc

    def _on_revoked(self, sender: Any = None, request: Any = None, **kwargs: Any) -> None:
        """A task revoked (or expired) before it was admitted frees its unique key.

        Runs on the worker's consumer loop: the release is handed to admission, which
        sends it without waiting for the store and retries it until the store answers."""
        if sender is None or request is None or self.app.tasks.get(sender.name) is not sender:
            return
        policy = self.policy_for(sender)
        if policy is None or policy.unique is None:
            return
        try:
            key = policy.unique_key(self.names, request.args or (), request.kwargs or {})
        except BatonError as exc:
            logger.warning(
                "could not free the unique key of revoked %s[%s]: %s", sender.name, request.id, exc
            )
            return
        if self.admission is not None:
            self.admission.release_unique(key, request.id)
        else:  # not in a worker's consumer: nothing to block, but do not wait here either
            self.release_unique_later(key, request.id, policy.unique_ttl)

    def on_lease_lost(self, owner: str, key: str) -> None:
        logger.error(
            "a running task lost its lease %s (owner %s): another run may have "
            "started; use fence() to refuse its late writes",
            key,
            owner,
        )


__all__ = ["TASK_OPTIONS", "Baton", "baton_for"]
