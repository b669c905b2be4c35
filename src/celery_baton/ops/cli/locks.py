"""``baton locks`` (live leases and unique claims, each key whole to paste) and
``baton unlock KEY``."""

from __future__ import annotations

from typing import Any

import click

from celery_baton.errors import BatonError
from celery_baton.ops import state
from celery_baton.ops.cli.group import baton, context_of
from celery_baton.ops.cli.output import emit, fail, json_option, show, watch_option
from celery_baton.store import inspect as store_inspect


@baton.command()
@json_option
@watch_option
@click.pass_context
def locks(ctx: click.Context, as_json: bool = False, watch: float | None = None) -> None:
    """Live leases and unique claims: key, kind, holder task id, worker, fence, TTL left.

    Keys are printed whole: paste one into `unlock`. A lease whose worker stopped
    reporting is marked stale (it ends when its TTL runs out)."""
    c = context_of(ctx)

    def render() -> tuple[Any, str]:
        rows = state.holders(c)
        # Each key on a line of its own, whole, to paste into `unlock`; its holder below.
        lines = []
        for r in rows:
            lines.append(r.key)
            if r.label:  # the key in words: which feed, which user
                lines.append(f"    {r.label}")
            lines.append(f"    {r.kind}  task {r.task_id}  ttl {r.ttl_left:.1f}s")
            if r.worker:
                fence = f"  fence {r.fence}" if r.fence else ""
                stale = "  STALE: stopped reporting" if r.stale else ""
                lines.append(f"    on {r.worker}{fence}{stale}")
        text = "\n".join(lines) if rows else "no live leases or unique claims"
        return [r.as_dict() for r in rows], text

    show(ctx, render, watch)


@baton.command()
@click.argument("key")
@click.option("--force", is_flag=True, help="Free it even if a live run holds it.")
@json_option
@click.pass_context
def unlock(ctx: click.Context, key: str, force: bool, as_json: bool = False) -> None:
    """Free lease or unique claim KEY (as shown by `locks`); refuses a live holder
    unless --force."""
    c = context_of(ctx)
    try:
        if not store_inspect.exists(c.store, key):
            raise click.ClickException(f"{key}: no such lease or unique claim (see `locks`)")
        live_workers = state.live_workers(c)
        words = store_inspect.label(c.store, key)
        removed, live = store_inspect.unlock(
            c.store, key, force=force, channel=c.names.notice_channel
        )
    except BatonError as exc:
        fail(exc)
    named = f"{key} ({words})" if words else key
    if live and not force:
        raise click.ClickException(
            f"{named} {state.holders_in_words(live, live_workers)}. Use --force to free it."
        )
    emit(
        ctx,
        {"key": key, "label": words, "removed": removed, "was_live": live},
        f"{named}: {removed} holder(s) removed",
    )
