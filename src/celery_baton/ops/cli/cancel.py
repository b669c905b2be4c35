"""``baton cancel TASK_ID`` / ``baton cancel --task NAME --key JSON [--terminate]``:
``baton.cancel`` from the command line (celery_baton/cancel.py)."""

from __future__ import annotations

import json

import click

from celery_baton.cancel import cancel as cancel_calls
from celery_baton.core.cancels import Cancels
from celery_baton.errors import BatonError
from celery_baton.ops.cli.group import baton, context_of
from celery_baton.ops.cli.output import emit, fail, json_option


@baton.command()
@click.argument("task_id", required=False)
@click.option("--task", "task_name", help="The task whose calls of --key to cancel.")
@click.option("--key", "key_json", help='The key\'s argument values, JSON: {"account_id": 7}.')
@click.option("--terminate", is_flag=True, help="Also stop a running body (Celery's revoke).")
@click.option("--ttl", type=float, help="Seconds the cancel is kept (baton_cancel_ttl).")
@json_option
@click.pass_context
def cancel(
    ctx: click.Context,
    task_id: str | None,
    task_name: str | None,
    key_json: str | None,
    terminate: bool,
    ttl: float | None,
    as_json: bool = False,
) -> None:
    """Cancel call TASK_ID, or every queued call of --task with --key: it never starts,
    on any worker, also one started later; its result is REVOKED."""
    c = context_of(ctx)
    key = None
    if key_json is not None:
        try:
            key = json.loads(key_json)
        except ValueError as exc:
            raise click.BadParameter(f"not JSON: {exc}", param_hint="--key") from None
    if (task_id is None) == (task_name is None and key is None):
        raise click.UsageError("give TASK_ID, or --task NAME --key JSON")
    if task_name is not None:  # a name typed wrong would cancel nothing, silently
        c.refuse_unknown_task(task_name)
    try:
        done = cancel_calls(
            c.parts,
            task_id,
            task=task_name,
            key=key,
            terminate=terminate,
            ttl=ttl,
            records=Cancels(c.store, c.names),
        )
    except BatonError as exc:
        fail(exc)
    data = {
        "cancelled": done.what,
        "ttl": done.ttl,
        "revoked": done.revoked,
        "terminated": list(done.terminated),
    }
    extra = f"; terminated {', '.join(done.terminated)}" if done.terminated else ""
    emit(ctx, data, f"cancelled {done.what} for {done.ttl:.0f}s{extra}")
