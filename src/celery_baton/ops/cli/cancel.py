"""``baton cancel TASK_ID`` / ``baton cancel --task NAME --key JSON [--terminate]``:
``baton.cancel`` from the command line (celery_baton/cancel.py)."""

from __future__ import annotations

import json
import logging
from typing import Any

import click
from celery import states

from celery_baton.cancel import Cancelled
from celery_baton.cancel import cancel as cancel_calls
from celery_baton.core.cancels import Cancels
from celery_baton.errors import BatonError
from celery_baton.ops.cli.group import baton, context_of
from celery_baton.ops.cli.output import emit, fail, json_option
from celery_baton.worker.transport.queued import DELIVERED, QUEUED, queued

logger = logging.getLogger("celery_baton")


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
    in_broker = looked_up(c.app, task_id, done)
    data = {
        "cancelled": done.what,
        "ttl": done.ttl,
        "revoked": done.revoked,
        "terminated": list(done.terminated),
        "state": done.state,
        # "queued", "delivered" (to a worker, not acked), "" (not there), null: not known
        "in_broker": in_broker,
    }
    emit(ctx, data, in_words(done, in_broker))


def looked_up(app: Any, task_id: str | None, done: Cancelled) -> str | None:
    """For a cancel of one id whose result says nothing (PENDING, or no backend): where
    its message is in the broker (``queued``, ``delivered``, '': not there; None: not
    known, or not asked)."""
    if task_id is None or done.state not in (None, states.PENDING):
        return None
    try:
        return queued(app, task_id)
    except Exception as exc:  # the cancel is made: only what is said is less
        logger.warning("baton cancel: could not look for %s in the broker: %s", task_id, exc)
        return None


def in_words(done: Cancelled, in_broker: str | None) -> str:
    """What the cancel did and found, for the CLI and the web view."""
    extra = f"; terminated {', '.join(done.terminated)}" if done.terminated else ""
    return f"cancelled {done.what} for {done.ttl:.0f}s{extra}{_found(done, in_broker)}"


def _found(done: Cancelled, in_broker: str | None) -> str:
    """What the cancel of one id found of its call, in words ('' : nothing to add)."""
    if done.state == states.REVOKED:
        return "; it was revoked or cancelled already"
    if done.state in states.READY_STATES:
        return f"; it had already ended ({done.state}): nothing of it was stopped"
    if done.state == states.STARTED and not done.terminated:
        return "; it is running: its body goes on (--terminate stops it)"
    if in_broker == QUEUED:
        return "; it was waiting in the broker: it will not start"
    if in_broker == DELIVERED:
        return (
            "; a worker has it, not acknowledged: held for later (it will not start), or"
            " running under acks_late (its body goes on without --terminate)"
        )
    if in_broker == "":
        return (
            "; it is not in the broker's queues: it is running or ended without a result"
            " (Celery records neither by default), or the id is mistyped"
        )
    return ""
