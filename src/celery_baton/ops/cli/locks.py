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

#: How many of the holders `unlock --task/--all` lists before it asks.
SHOWN_BEFORE_ASKING = 20


@baton.command()
@json_option
@watch_option
@click.pass_context
def locks(ctx: click.Context, as_json: bool = False, watch: float | None = None) -> None:
    """Live leases and unique claims (key, kind, holder task id, worker, fence, TTL
    left), ordered keys with a call running or queued, and batch keys with calls waiting
    or a batch running.

    Keys are printed whole: paste one into `unlock`. A lease whose worker stopped
    reporting is marked stale (it ends when its TTL runs out)."""
    c = context_of(ctx)

    def render() -> tuple[Any, str]:
        rows = state.holders(c)
        live = state.live_workers(c)
        ordered = state.ordered_keys(c, live)
        batches = state.batch_keys(c, live)
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
        for entry in ordered:
            lines += ordered_text(entry)
        for entry in batches:
            lines += batch_text(entry)
        text = "\n".join(lines) or "no live leases, unique claims, ordered keys or batches"
        return [r.as_dict() for r in rows] + ordered + batches, text

    show(ctx, render, watch)


def ordered_text(entry: dict[str, Any]) -> list[str]:
    """An ordered key as `locks` prints it (``entry``: state.ordered_entry): its key,
    its words, its turn and queue, and its running call or when the gap bound skips."""
    lines = [entry["key"]]
    if entry["label"]:
        lines.append(f"    {entry['label']}")
    queued = f"queued {entry['queued']}"
    if entry["held"]:
        queued += f" ({entry['held']} held in workers)"
    lines.append(f"    ordered  next {entry['next']}  {queued}")
    running = entry["running"]
    if running is not None:
        lines.append(f"    running  task {running['task_id']}  ttl {running['ttl_left']:.1f}s")
        stale = "  STALE: stopped reporting" if running["stale"] else ""
        lines.append(f"    on {running['worker']}{stale}")
    else:
        lines.append(f"    next {entry['next']} {state.gap_words(entry)}")
    return lines


def batch_text(entry: dict[str, Any]) -> list[str]:
    """A batch key as `locks` prints it (``entry``: state.batch_entry): its key, its
    words, its waiting calls and next batch, and each batch running."""
    lines = [entry["key"]]
    if entry["label"]:
        lines.append(f"    {entry['label']}")
    if entry["waiting"]:
        line = f"    batch  {entry['waiting']} waiting, oldest {entry['oldest']:.1f}s"
        if entry["due_in"] is not None:
            line += f"  next batch {_due(entry['due_in'])}"
        lines.append(line)
    for run in entry["runs"]:
        lines.append(
            f"    running  batch of {run['calls']} calls  for {run['age']:.1f}s  "
            f"ttl {run['ttl_left']:.1f}s"
        )
        stale = "  STALE: stopped reporting" if run["stale"] else ""
        lines.append(f"    on {run['worker']}{stale}")
    return lines


def _due(seconds: float) -> str:
    return "due now" if seconds <= 0 else f"due in {seconds:.1f}s"


@baton.command()
@click.argument("key", required=False)
@click.option("--task", "task_name", help="Every lease and unique claim of task NAME.")
@click.option("--all", "every", is_flag=True, help="Every lease and unique claim of this store.")
@click.option("--force", is_flag=True, help="Free it even if a live run holds it.")
@click.option("--yes", is_flag=True, help="With --task or --all: do not ask first.")
@json_option
@click.pass_context
def unlock(
    ctx: click.Context,
    key: str | None,
    task_name: str | None,
    every: bool,
    force: bool,
    yes: bool,
    as_json: bool = False,
) -> None:
    """Free lease or unique claim KEY (as shown by `locks`); refuses a live holder
    unless --force. `--task NAME` or `--all` frees many at once, after asking
    (celery-once's and celery-singleton's `clear_locks(app)`)."""
    if sum(map(bool, (key, task_name, every))) != 1:
        raise click.UsageError("name one KEY, or --task NAME, or --all")
    if key is None:
        _unlock_many(ctx, task_name, force=force, yes=yes)
        return
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


def _unlock_many(ctx: click.Context, task_name: str | None, *, force: bool, yes: bool) -> None:
    """``unlock --task NAME`` / ``--all``: what ``locks`` lists of it, each freed as
    ``unlock KEY`` frees it (a live holder kept unless --force), after one question."""
    c = context_of(ctx)
    try:
        rows = [r for r in state.holders(c) if task_name is None or r.task == task_name]
    except BatonError as exc:
        fail(exc)
    what = f"task {task_name}" if task_name else "this store"
    if not rows and task_name is not None:  # a task gone from the app may still hold keys
        c.refuse_unknown_task(task_name)
    if not rows:
        emit(ctx, {"freed": [], "kept": []}, f"{what}: no lease or unique claim to free")
        return
    claims = sum(1 for r in rows if r.kind == "unique")
    leases = len(rows) - claims
    if not force and not leases:  # a claim's task is queued or running: only --force frees it
        raise click.ClickException(
            f"{what}: {claims} unique claim(s), each of a queued or running task; "
            "--force frees them"
        )
    if not yes:  # what the question is about, before it is asked
        for row in rows[:SHOWN_BEFORE_ASKING]:
            click.echo(f"  {row.kind:<10} {row.label or row.key}  (task {row.task_id})", err=True)
        if len(rows) > SHOWN_BEFORE_ASKING:
            click.echo(f"  ... and {len(rows) - SHOWN_BEFORE_ASKING} more", err=True)
    question = (
        f"Free {leases} lease(s) and {claims} unique claim(s) of {what}?"
        if force
        else f"Free {leases} lease(s) of {what}, those of no live run (a live run's lease"
        f" and the {claims} unique claim(s) are kept: --force frees them)?"
    )
    if not yes and not click.confirm(question, default=False, err=True):
        raise click.ClickException("nothing freed (answer y, or pass --yes)")
    freed: list[str] = []
    kept: list[str] = []
    try:
        for row in rows:
            _, live = store_inspect.unlock(
                c.store, row.key, force=force, channel=c.names.notice_channel
            )
            (kept if live and not force else freed).append(row.key)
    except BatonError as exc:
        fail(exc)
    text = f"{what}: {len(freed)} freed"
    if kept:
        text += f", {len(kept)} kept (held by live runs or claimed; --force frees them)"
    emit(ctx, {"freed": freed, "kept": kept}, text)
