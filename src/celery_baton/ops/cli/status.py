"""``baton status`` (the store, its grace, the workers and their leases) and
``baton end-grace``."""

from __future__ import annotations

import time
from typing import Any

import click

from celery_baton.errors import BatonError
from celery_baton.ops import state
from celery_baton.ops.cli.group import baton, context_of
from celery_baton.ops.cli.output import emit, fail, json_option, show, table, watch_option
from celery_baton.store import inspect as store_inspect


@baton.command()
@json_option
@watch_option
@click.pass_context
def status(ctx: click.Context, as_json: bool = False, watch: float | None = None) -> None:
    """Store URL, server version, round trip, workers and their leases."""
    c = context_of(ctx)

    def render() -> tuple[Any, str]:
        data = state.status(c)
        stale = data["stale_leases"]
        where = " (embedded: this machine only)" if data["embedded"] else ""
        if data["store_from"] == "broker_url":
            where = " (the broker's Redis: no baton_url is set)"
        text = [
            f"store:    {data['store']}{where}",
            f"server:   {data['server']}",
            f"rtt:      {data['rtt_ms']} ms",
            *([f"grace:    {data['grace']}"] if data["grace"] else []),
            *[f"WARNING:  {warning}" for warning in data["warnings"]],
            f"leases:   {data['leases']}"
            + (f" ({stale} stale: their workers stopped reporting)" if stale else ""),
            "",
            table(
                [(w["hostname"], w["leases"], w["held"], w["admitted"]) for w in data["workers"]],
                ["worker", "leases", "held", "admitted"],
                keep=(0,),
            )
            if data["workers"]
            else "no live workers",
        ]
        if data["ordered"]:
            text += [
                "",
                table(
                    [
                        (
                            # The key in words names its task; a line without: the key.
                            line["label"] or f"{line['task']} {line['key']}",
                            line["next"],
                            line["waiting"],
                            f"{line['idle']:.1f}s",
                            _skips(line),
                        )
                        for line in data["ordered"]
                    ],
                    ["ordered key", "next", "waiting", "idle", "skipped (gap bound)"],
                    keep=(0,),
                ),
            ]
        return data, "\n".join(text)

    show(ctx, render, watch)


def _skips(line: dict[str, Any]) -> str:
    """An ordered line's skips in words: how many, and the latest (positions, when)."""
    if not line["skipped"]:
        return "0"
    latest, _, at_ms = line["last_skip"].partition(" ")
    when = time.strftime("%H:%M:%S", time.gmtime(int(at_ms) / 1000)) if at_ms else "?"
    return f"{line['skipped']} (latest: {latest} at {when} UTC)"


@baton.command("end-grace")
@click.option(
    "--force",
    is_flag=True,
    help="End it even while workers report (none of them ran before the loss: a new store).",
)
@json_option
@click.pass_context
def end_grace(ctx: click.Context, force: bool = False, as_json: bool = False) -> None:
    """Grant leases at once on a store that is new or was emptied with no worker
    running: ends the grace (one lease_ttl) a store found without its data gets. Never
    while workers that ran before the loss may still hold runs: refused while workers
    report, unless --force."""
    c = context_of(ctx)
    try:
        # What `status` says of the grace: nothing to end when it says none.
        if not state.grace(c):
            emit(ctx, {"grace": "", "ended": False}, "no grace in effect")
            return
        live = sorted(r["hostname"] for r in store_inspect.workers(c.store, c.names.prefix))
        if live and not force:
            raise click.ClickException(
                f"{len(live)} worker(s) reported in the last seconds ({', '.join(live)}): "
                "a run one of them started before the store lost its data may still hold "
                "its key, and the grace keeps a second run of it from starting. Stop them "
                "first, or, if none of them ran before the loss (a new store), run again "
                "with --force"
            )
        store_inspect.end_grace(c.store, c.names.prefix)
    except BatonError as exc:
        fail(exc)
    emit(ctx, {"grace": "", "ended": True}, "grace ended: new leases are granted at once")
