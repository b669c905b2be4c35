"""The ``baton`` command group and what every sub-command reads through: the app, its
settings and its store (:class:`Context`, the read model's ``Source``)."""

from __future__ import annotations

import difflib
import functools
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import click

from celery_baton.config import Settings
from celery_baton.core.policy.options import TASK_OPTIONS, declares_options
from celery_baton.errors import BatonError
from celery_baton.ops.cli.output import fail
from celery_baton.parts import installed_parts, parts_for
from celery_baton.store import Store

if TYPE_CHECKING:
    from celery_baton.core.policy.model import TaskPolicy


class Context:
    """What every sub-command needs: the app, its settings, the store."""

    def __init__(self, app: Any) -> None:
        self.app = app
        # The tasks of `include=`, `imports` and `autodiscover_tasks()`, as a worker
        # imports them at start: `-A proj` alone imports only the app's module, and
        # `limits`, `unlock --task` and `cancel --task` would not know those tasks.
        app.loader.import_default_modules()
        self.parts = parts_for(app)
        self.settings: Settings = self.parts.settings
        self.names = self.parts.names

    @functools.cached_property
    def store(self) -> Store:
        # An operator's look never starts an embedded server: with no URL set it reads
        # the one running on this machine, if any.
        try:
            return self.parts.connect(client_name="celery-baton-cli", start_embedded=False)
        except BatonError as exc:
            if installed_parts(self.app) is not None:
                raise
            # Most often `-A proj` was left out: Celery's default app has no settings.
            raise BatonError(
                f"{exc}; app {self.app.main!r} never called Baton(app): is `-A proj` "
                "missing (celery -A proj baton ...)?"
            ) from exc

    def tasks_named(self, name: str) -> list[str]:
        """This app's tasks (Celery's own aside) whose function is ``name``, at most 3:
        `build_report` for `proj.tasks.build_report`, too short for difflib to match."""
        return [
            n
            for n in self.app.tasks
            if not n.startswith("celery.") and n.rsplit(".", 1)[-1] == name
        ][:3]

    def near_tasks(self, name: str) -> str:
        """``"; did you mean proj.slow or proj.flow?"``: this app's tasks near a name it
        does not have (typed wrong, `proj.tasks.x` for `proj.x`), else ``""``."""
        names = [n for n in self.app.tasks if not n.startswith("celery.")]
        close = (
            self.tasks_named(name)
            or self.tasks_named(name.rsplit(".", 1)[-1])
            or difflib.get_close_matches(name, names, n=3, cutoff=0.5)
        )
        return f"; did you mean {' or '.join(close)}?" if close else ""

    def refuse_unknown_task(self, name: str) -> None:
        """A task name this app does not have is refused with the names near it, not
        taken as "nothing there"."""
        if name in self.app.tasks:
            return
        hint = self.near_tasks(name) or " (`locks` lists them)"
        raise click.UsageError(f"this app has no task {name!r}{hint}")

    def policies(self) -> Mapping[str, tuple[Any, TaskPolicy]]:
        result = {}
        for name, task in sorted(self.app.tasks.items()):
            policy = self.parts.policy_for(task)
            if policy is not None:
                result[name] = (task, policy)
        return result


class _Commands(click.Group):
    """Under ``--json`` (given anywhere on the line) an error is JSON too, on stdout
    (``{"error": "..."}``), with the same exit status: a script that asked for JSON
    never has to parse ``Error: ...``."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta["baton_json"] = "--json" in args
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.ClickException as exc:
            if not ctx.meta.get("baton_json"):
                raise
            click.echo(json.dumps({"error": exc.format_message()}))
            raise click.exceptions.Exit(exc.exit_code) from exc


@click.group(name="baton", cls=_Commands)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
@click.pass_context
def baton(ctx: click.Context, as_json: bool = False) -> None:
    """celery-baton: leases, limits and the beat schedule in the store."""
    app = ctx.obj.app if ctx.obj is not None and hasattr(ctx.obj, "app") else None
    if app is None:
        raise click.UsageError("run as: celery -A proj baton ...")
    try:
        ctx.obj = {"baton": Context(app), "json": as_json}
    except BatonError as exc:  # a bad setting or URL: one line, not a traceback
        fail(exc)
    unguarded = unguarded_tasks(app)
    if unguarded:
        # The worker and the first publish say so; the operator's first look at an app
        # that forgot Baton(app) showed "no live leases" and nothing else.
        click.echo(
            f"warning: Baton(app) was never called for app {app.main!r} (-A loads it "
            f"without celery-baton): its tasks {', '.join(unguarded)} declare celery-baton "
            "options that do nothing there; call Baton(app) in the module that creates the "
            "app (docs/configuration.md)",
            err=True,
        )


def unguarded_tasks(app: Any) -> list[str]:
    """The app's tasks that declare celery-baton options when ``Baton(app)`` was never
    called for it (none when it was)."""
    if installed_parts(app) is not None:
        return []
    return sorted(
        name
        for name, task in list(app.tasks.items())
        if declares_options({o: getattr(task, o, None) for o in TASK_OPTIONS})
    )


def context_of(ctx: click.Context) -> Context:
    context: Context = ctx.obj["baton"]
    return context
