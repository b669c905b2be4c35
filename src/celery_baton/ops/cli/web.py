"""``baton web``: serves the web view (``ops/web``) of this app's store."""

from __future__ import annotations

import functools
from typing import Any

import click

from celery_baton.cancel import cancel as cancel_calls
from celery_baton.core.cancels import Cancels
from celery_baton.errors import BatonError
from celery_baton.ops.cli.cancel import in_words, looked_up
from celery_baton.ops.cli.group import Context, baton, context_of
from celery_baton.ops.cli.output import fail


@baton.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=8765,
    show_default=True,
    help="0: any free port.",
)
@click.option(
    "--token",
    envvar="BATON_WEB_TOKEN",
    default=None,
    help="Enables the actions (unlock, pause, resume, trigger, cancel) for whoever gives it "
    "[env: BATON_WEB_TOKEN]. Without it the page is read-only.",
)
@click.option("--refresh", type=float, default=5.0, show_default=True, help="Seconds.")
@click.pass_context
def web(ctx: click.Context, host: str, port: int, token: str | None, refresh: float) -> None:
    """Serve the web view: workers, leases, unique claims, limits, schedule; the CLI's
    actions behind --token; /api/state (JSON) and /metrics (Prometheus, every worker)."""
    from celery_baton.beat.api import ScheduleStore
    from celery_baton.ops.web.server import TOKEN_CHARS, serve

    c = context_of(ctx)
    if token is not None and not TOKEN_CHARS.fullmatch(token):
        raise click.BadParameter(
            "letters, digits and . _ ~ + / = - only (it travels in a cookie)",
            param_hint="--token",
        )
    if refresh < 0.5:
        raise click.BadParameter("must be >= 0.5", param_hint="--refresh")
    try:
        c.store.ping()  # fail now with one line, not on the first page load
    except BatonError as exc:
        fail(exc)

    def ready(server: Any) -> None:
        mode = "actions need the token" if token else "read-only: no --token"
        click.echo(f"celery-baton web view on {server.url} ({mode}); Ctrl-C stops it")

    try:
        serve(
            c,
            ScheduleStore(c.app, store=c.store),
            host=host,
            port=port,
            token=token,
            refresh=refresh,
            ready=ready,
            cancel=functools.partial(_cancel, c),
        )
    except OSError as exc:  # the port is taken, or the address is not this host's
        raise click.ClickException(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}"
        ) from exc


def _cancel(c: Context, task_id: str | None, task: str | None, key: Any, terminate: bool) -> str:
    """The web view's cancel: ``baton.cancel`` on the CLI's store connection."""
    done = cancel_calls(
        c.parts, task_id, task=task, key=key, terminate=terminate, records=Cancels(c.store, c.names)
    )
    return in_words(done, looked_up(c.app, task_id, done))
