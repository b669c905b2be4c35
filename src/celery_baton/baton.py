"""``Baton(app)``: installs celery-baton on a Celery app."""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable, Mapping
from typing import Any

from celery import Celery
from celery import Task as CeleryTask
from celery import signals as celery_signals

from celery_baton import internals
from celery_baton.cancel import Cancelled, cancel
from celery_baton.config import Settings
from celery_baton.core.debounce import Debounces
from celery_baton.core.gate import Gate
from celery_baton.core.keys import KeyNames
from celery_baton.core.policy.compile import compile_policy
from celery_baton.core.policy.model import TaskPolicy
from celery_baton.core.policy.options import TASK_OPTIONS, check_option_names, declares_options
from celery_baton.core.shared_limits import NamedLimit, parse_limits, resolve
from celery_baton.core.unique import UniqueClaims
from celery_baton.errors import BatonError, ConfigError
from celery_baton.parts import AppParts, installed_parts, parts_for, task_option
from celery_baton.publish import guard_send_task
from celery_baton.store.connection import Store
from celery_baton.worker.pool import connect_ahead, run_end
from celery_baton.worker.pool.batch_run import batch_body, wrap_task
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


#: Other extensions' options that act only on a task of their class: left on a task whose
#: base is no longer that class (a migration removed the base, kept the option) they do
#: nothing, and the guarantee a reader sees there is gone without a word.
EXTENSION_OPTIONS = {
    "once": ("celery-once", "QueueOnce", "unique=..."),
    "unique_on": ("celery-singleton", "Singleton", "unique=..."),
    "lock_expiry": ("celery-singleton", "Singleton", "unique_ttl=..."),
    "raise_on_duplicate": ("celery-singleton", "Singleton", 'unique_conflict="raise"'),
}


def check_no_orphan_options(name: str, options: dict[str, Any], app_task: Any) -> None:
    """``once={...}`` on a task that is not a QueueOnce (``unique_on=`` not a Singleton):
    refused, naming celery-baton's option, rather than silently doing nothing."""
    base = options.get("base") or app_task
    orphans = [
        f"`{option}` is {package}'s option and does nothing without base={cls} "
        f"(celery-baton's is {ours}; docs/migration.md)"
        for option, (package, cls, ours) in EXTENSION_OPTIONS.items()
        if option in options and not hasattr(base, option)
    ]
    if orphans:
        raise ConfigError("; ".join(orphans), subject=name)


def check_declared_names(
    name: str, options: dict[str, Any], others: frozenset[str], app_task: Any
) -> None:
    """A declaration's option names: another extension's left on a task without its
    base class, then misspelt ones (``exclusiv=``). In that order because one of theirs
    may be close to one of ours: ``unique_on=`` left behind with celery-singleton no
    longer imported was refused as a typo of ``unique`` (did you mean `unique`?), which
    hid that it is celery-singleton's option and that ours takes the same list."""
    check_no_orphan_options(name, options, app_task)
    check_option_names(name, options, others)


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
    decorate: Callable[..., Any], options: dict[str, Any], others: frozenset[str], app_task: Any
) -> Callable[..., Any]:
    """``@app.task(exclusiv=...)``: the function is known only when the decorator runs."""

    def decorator(fun: Callable[..., Any]) -> Any:
        check_declared_names(_name_of(fun, options), options, others, app_task)
        return decorate(fun)

    return decorator


def _check_declaration(
    app: Any, fun: Callable[..., Any], options: dict[str, Any], others: frozenset[str]
) -> None:
    """What ``@app.task(**options)`` is checked for: misspelt option names, then the
    options themselves (a key naming no argument, a bad rate, an option without the one
    it qualifies), raising ConfigError naming the task."""
    name = _name_of(fun, options)
    check_declared_names(name, options, others, app.Task)
    if declares_options(options):
        # Named limits are checked now when the app's conf already has them.
        conf = app.conf
        known = Settings(limits=conf.get("baton_limits", conf.get("BATON_LIMITS")))
        compile_policy(name, options.get, fun, known, bound=bool(options.get("bind")))


#: What Celery itself puts in the class it makes of ``@app.task`` (``_task_from_fun``).
_MADE_BY_CELERY = frozenset(["app", "name", "run"])


def _declared_on(task: Any) -> dict[str, Any] | None:
    """The options a registered task was declared with, when ``@app.task(**options)``
    (or ``@shared_task``) made its class: its class's own attributes are then exactly
    those. None for a class-based task, whose own attributes are its author's (a near
    miss of one of ours there may be on purpose)."""
    own = vars(type(task))
    if not own.get("_decorated"):
        return None
    return {
        attr: value
        for attr, value in own.items()
        if not attr.startswith("_") and attr not in _MADE_BY_CELERY
    }


def check_task_option_names(app: Any, task: Any) -> None:
    """A registered task's misspelt option names (``exclusiv=``), refused as at
    declaration: for a task declared before ``Baton(app)`` or registered as a class."""
    options = _declared_on(task)
    if options is None:
        return
    base = type(task).__mro__[1] if len(type(task).__mro__) > 1 else None
    others = others_names({"base": base}, app.Task)
    check_declared_names(task.name, options, others, base or app.Task)


def check_declared_tasks(app: Any) -> None:
    """The tasks declared before ``Baton(app)``, checked as a declaration after it is:
    the same errors, when ``Baton(app)`` is made (issue 39 §2)."""
    declared = internals.declared_tasks(app)
    if declared is None:
        return  # checked at worker start (AppParts.validate_all_tasks)
    registered, pending = declared
    for fun, options in pending:
        _check_declaration(app, fun, options, others_names(options, app.Task))
    known = Settings(limits=app.conf.get("baton_limits", app.conf.get("BATON_LIMITS")))
    for task in registered:
        check_task_option_names(app, task)
        if declares_options({o: getattr(task, o, None) for o in TASK_OPTIONS}):
            policy = compile_policy(
                task.name, functools.partial(task_option, task), task.run, known
            )
            if policy is not None and policy.batch is not None:
                wrap_task(task)


def baton_for(app: Any) -> Baton | None:
    """The Baton installed on ``app``, if any."""
    parts = installed_parts(app)
    baton = None if parts is None else parts.installed_by
    return baton if isinstance(baton, Baton) else None


def _unguarded(app: Any, tasks: list[Any]) -> list[str]:
    """The ``tasks`` of ``app`` that declare celery-baton options when it never called
    ``Baton(app)`` (none when it did): those options do nothing there."""
    if installed_parts(app) is not None:
        return []
    return sorted(
        task.name
        for task in tasks
        if any(getattr(task, option, None) is not None for option in TASK_OPTIONS)
    )


def _say_unguarded(app: Any, names: list[str], where: str) -> None:
    logger.warning(
        "%s: tasks %s declare celery-baton options, but Baton(app) was never called for "
        "app %r: they run UNGUARDED (unique publishes are not deduplicated, exclusive runs "
        "overlap, limits are not kept). Call Baton(app) in the module that creates the "
        "app, so every process that imports it has it (docs/configuration.md).",
        where,
        ", ".join(names),
        app.main,
    )


def _warn_if_not_installed(sender: Any = None, **kwargs: Any) -> None:
    """A worker of an app whose tasks declare celery-baton options but that never called
    ``Baton(app)``: those options do nothing (``unique`` would be a silent no-op)."""
    app = getattr(sender, "app", None)
    if app is None:
        return
    names = _unguarded(app, list(app.tasks.values()))
    if names:
        _say_unguarded(app, names, "worker")


#: Task names whose first publish was looked at (a publish of an app without Baton).
_publishes_seen: set[str] = set()
_apps_told: set[int] = set()


def _warn_publish_if_not_installed(sender: Any = None, **kwargs: Any) -> None:
    """The first publish of each task name in this process: when the current app never
    called ``Baton(app)`` but the task declares celery-baton options, say so once for
    the app. Every later publish costs one set lookup."""
    if sender in _publishes_seen:
        return
    _publishes_seen.add(sender)
    from celery import current_app

    app = current_app._get_current_object()
    declared = internals.declared_tasks(app)  # never finalizes the app
    if id(app) in _apps_told or declared is None:
        return
    names = _unguarded(app, declared[0])
    if str(sender) in names:
        _apps_told.add(id(app))
        _say_unguarded(app, names, "publish")


def _warn_if_beat_ignores_entry_options(sender: Any = None, **kwargs: Any) -> None:
    """A beat that does not run celery-baton's scheduler, with entries that carry its
    options (``baton_misfire``...): Celery's scheduler sends them along unread, and every
    beat process fires every tick. A migration that added the options but whose
    ``beat_scheduler`` was not read (a Django setting without ``CELERY_``, a beat started
    without ``-S``) looked like it worked. Said at beat start, naming the entries."""
    scheduler = getattr(sender, "scheduler", None)
    if scheduler is None:
        return
    from celery_baton.beat.scheduler import Scheduler as BatonScheduler

    if isinstance(scheduler, BatonScheduler):
        return
    try:
        entries = dict(scheduler.schedule)
    except Exception:  # another scheduler's store: its own errors are its own
        return
    named = sorted(
        str(name)
        for name, entry in entries.items()
        if any(str(k).startswith("baton_") for k in (getattr(entry, "options", None) or {}))
    )
    if named:
        logger.warning(
            "beat: entries %s have celery-baton options (baton_misfire, baton_overlap...) "
            "but this beat runs %s.%s, not celery-baton's scheduler: they are sent along "
            "unread, and each beat process fires every tick. Set beat_scheduler = "
            '"celery_baton.beat:Scheduler" (or celery beat -S celery_baton.beat:Scheduler)',
            ", ".join(named),
            type(scheduler).__module__,
            type(scheduler).__qualname__,
        )


#: Task names whose eager run was said (once per task per process).
_eager_told: set[str] = set()


def _say_eager_runs_are_not_coordinated(sender: Any = None, task: Any = None, **_: Any) -> None:
    """``task_prerun`` of an eager run (``task_always_eager``, ``.apply()``) of a task
    that declares celery-baton options: none of them applies (nothing is published, no
    worker admits it), so a test passes that proves nothing. Said once per task name; a
    worker's run pays one attribute read."""
    if task is None or not getattr(task.request, "is_eager", False):
        return
    name = str(getattr(task, "name", ""))
    if name in _eager_told or installed_parts(task.app) is None:
        return
    _eager_told.add(name)
    declared = sorted(o for o in TASK_OPTIONS if getattr(task, o, None) is not None)
    if declared:
        logger.warning(
            "%s ran eagerly (task_always_eager or .apply()): its celery-baton options (%s) "
            "are not applied to eager runs: nothing is published and no worker admits "
            "it (no deduplication, no lease, no limit). Test them with a real worker "
            "(docs/migration.md); said once per task",
            name,
            ", ".join(declared),
        )


celery_signals.before_task_publish.connect(_warn_publish_if_not_installed, weak=False)
celery_signals.task_prerun.connect(_say_eager_runs_are_not_coordinated, weak=False)
celery_signals.worker_init.connect(_warn_if_not_installed, weak=False)
celery_signals.beat_init.connect(_warn_if_beat_ignores_entry_options, weak=False)


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
            raise BatonError(
                f"celery-baton is already installed on app {app.main!r}: call Baton(app) "
                "once, where the app is made, and import that object where you need it "
                "(e.g. `from proj.celery import baton` for baton.cancel)"
            )
        # Tasks declared before Baton(app) get the checks of those declared after it.
        check_declared_tasks(app)
        self.app = app
        self.parts: AppParts = parts_for(app, url=url)
        self.parts.check_option_names = functools.partial(check_task_option_names, app)
        self.parts.installed_by = self
        # Celery builds the consumer bootstep from the app alone: it finds the parts
        # through parts_for(app).
        app.steps["consumer"].add(BatonConsumer)
        run_end.install()
        connect_ahead.install(self.parts)
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
                check_declared_names(_name_of(args[0], options), options, others, self.app.Task)
            if not declares_options(options):
                if options and not (len(args) == 1 and callable(args[0])):
                    return _checked_later(
                        task_decorator(*args, **options), options, others, self.app.Task
                    )
                return task_decorator(*args, **options)

            if len(args) == 1 and callable(args[0]):
                _check_declaration(self.app, args[0], options, others)
                if options.get("batch") not in (None, False):  # app.task(fun, batch=...)
                    args = (batch_body(args[0], bound=bool(options.get("bind"))),)
                return task_decorator(*args, **options)
            decorate = task_decorator(*args, **options)

            def decorator(fun: Callable[..., Any]) -> Any:
                _check_declaration(self.app, fun, options, others)
                if options.get("batch") not in (None, False):
                    # The body takes the list of calls; the task takes a call's arguments.
                    fun = batch_body(fun, bound=bool(options.get("bind")))
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

    def cancel(
        self,
        task_id: str | None = None,
        *,
        task: Any = None,
        key: Mapping[str, Any] | None = None,
        terminate: bool = False,
        ttl: float | None = None,
    ) -> Cancelled:
        """Cancel a call, or every queued call of one key, so that it never starts,
        wherever its message is (the broker, held in a worker, an ETA or countdown, a
        retry's re-publish, a redelivered copy) and whichever worker receives it, also
        one started after the cancel::

            baton.cancel(result.id)                                 # one call
            baton.cancel(task=apply_event, key={"account_id": 7})  # its queued calls
            baton.cancel(result.id, terminate=True)                # also a running body

        The result state is ``REVOKED`` (``AsyncResult.get()`` raises
        ``TaskRevokedError``). A cancel is kept ``ttl`` seconds (``baton_cancel_ttl``;
        by default the broker's visibility timeout, or a day), then forgotten. A cancel
        by key cancels the calls published until now whose arguments hold ``key``'s
        values; later calls run. Raises StoreUnavailable, KeySpecError (a key naming no
        argument of the task), BatonError (bad arguments).
        """
        return cancel(self.parts, task_id, task=task, key=key, terminate=terminate, ttl=ttl)

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
