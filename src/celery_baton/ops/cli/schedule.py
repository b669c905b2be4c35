"""``baton schedule`` (the beat schedule: next and last slot per entry, the leader) and
its sub-commands on one entry: pause, resume, trigger, history; and import from
celery-redbeat."""

from __future__ import annotations

import contextlib
from typing import Any

import click

from celery_baton.errors import BatonError
from celery_baton.ops.cli.group import baton, context_of
from celery_baton.ops.cli.output import emit, fail, json_option, show, table, watch_option
from celery_baton.store.connection import redact_url


@baton.group(invoke_without_command=True)
@json_option
@watch_option
@click.pass_context
def schedule(ctx: click.Context, as_json: bool = False, watch: float | None = None) -> None:
    """The beat schedule: next and last slot per entry, the leader, recent history.

    Subcommands act on one entry (the change survives leader changes: it is kept in the
    store and read by whichever beat leads)."""
    if ctx.invoked_subcommand is not None:
        return
    from celery_baton.beat.api import describe_schedule
    from celery_baton.beat.state import schedule_name

    c = context_of(ctx)

    def render() -> tuple[Any, str]:
        # The keys of this app's beat (its app.main), not another project's on the store.
        data = describe_schedule(c.store, c.names.prefix, app=schedule_name(c.app.main))
        leader = data.get("leader") or {}
        entries = data.get("entries", [])
        text = f"leader: {leader.get('owner') or 'none'}"
        if leader.get("lease_age_s") is not None:
            text += f" (leading for {leader['lease_age_s']:.1f}s, fence {leader.get('fence')})"
        rows = []
        for e in entries:
            policy = e.get("policy") or {}
            flags = f"{policy.get('misfire', 'skip')}/{policy.get('overlap', 'allow')}"
            rows.append(
                (
                    e.get("name"),
                    (e.get("next_slot") or "-")[:19],
                    (e.get("last_slot") or "-")[:19],
                    e.get("last_id") or "-",
                    f"{e.get('fired', 0)} / {e.get('missed', 0)}",
                    flags + (" paused" if e.get("paused") else ""),
                )
            )
        headers = ["entry", "next slot (UTC)", "last slot", "task id", "fired / missed", "policy"]
        # The entry's name and its task id are pasted into commands: never cut.
        text += "\n\n" + (table(rows, headers, keep=(0, 3)) if rows else _no_entries(c.app))
        if data.get("refused"):
            text += "\n\nrefused: " + ", ".join(f"{k} ({v})" for k, v in data["refused"].items())
        return data, text

    show(ctx, render, watch)


def _schedule_action(ctx: click.Context, name: str, action: str, done: str) -> None:
    from celery_baton.beat.api import ScheduleStore

    c = context_of(ctx)
    try:
        with ScheduleStore(c.app, store=c.store) as api:
            getattr(api, action)(name)
    except BatonError as exc:
        fail(exc)
    emit(ctx, {"entry": name, action: True}, f"{name}: {done}")


@schedule.command("pause")
@click.argument("name")
@json_option
@click.pass_context
def schedule_pause(ctx: click.Context, name: str, as_json: bool = False) -> None:
    """Stop firing entry NAME until `resume`."""
    _schedule_action(ctx, name, "pause", "paused")


def _no_entries(app: Any) -> str:
    """ "no entries", and why when the app's beat is another scheduler (RedBeat,
    Celery's own): its entries are not in celery-baton's store."""
    scheduler = str(app.conf.get("beat_scheduler") or "")
    if not scheduler or scheduler.startswith("celery_baton"):
        return "no entries"
    hint = (
        "; `celery baton schedule import --from-redbeat` copies its entries"
        if "redbeat" in scheduler.lower()
        else ""
    )
    return (
        f"no entries: this app's beat_scheduler is {scheduler}, whose entries are not "
        f"kept in celery-baton's store (celery_baton.beat:Scheduler keeps them){hint}"
    )


@schedule.command("resume")
@click.argument("name")
@json_option
@click.pass_context
def schedule_resume(ctx: click.Context, name: str, as_json: bool = False) -> None:
    """Fire entry NAME again, from its first slot after now (paused slots are not run)."""
    _schedule_action(ctx, name, "resume", "resumed")


@schedule.command("trigger")
@click.argument("name")
@json_option
@click.pass_context
def schedule_trigger(ctx: click.Context, name: str, as_json: bool = False) -> None:
    """Fire one extra run of entry NAME now, exactly once, with its own task id."""
    from celery_baton.beat.api import describe_schedule
    from celery_baton.beat.state import schedule_name

    c = context_of(ctx)
    done = "one extra run requested"
    with contextlib.suppress(BatonError):
        leader = describe_schedule(c.store, c.names.prefix, app=schedule_name(c.app.main))
        if not (leader.get("leader") or {}).get("owner"):
            # Nothing fires it until a beat leads: say so, not "requested" alone.
            done += (
                ", but no beat leads this schedule: it runs when a beat with "
                "celery_baton.beat:Scheduler starts"
            )
    _schedule_action(ctx, name, "trigger", done)


@schedule.command("history")
@click.argument("name")
@json_option
@click.pass_context
def schedule_history(ctx: click.Context, name: str, as_json: bool = False) -> None:
    """The last runs of entry NAME: slot, task id, when it was sent, and the outcome
    when a result backend has it."""
    from celery_baton.beat.api import describe_schedule
    from celery_baton.beat.state import schedule_name

    c = context_of(ctx)
    try:
        data = describe_schedule(c.store, c.names.prefix, app=schedule_name(c.app.main))
    except BatonError as exc:
        fail(exc)
    entry = next((e for e in data.get("entries", []) if e.get("name") == name), None)
    if entry is None:
        raise click.ClickException(f"no schedule entry named {name!r} (see `schedule`)")
    lines = []
    for line in entry.get("history") or []:
        task_id = line.get("id") or line.get("task_id") or ""
        state = ""
        if task_id and c.app.conf.result_backend:
            with contextlib.suppress(Exception):  # a backend that is down: no outcome
                state = c.app.AsyncResult(task_id).state
        lines.append({**line, "state": state})
    text = (
        table(
            [
                (
                    x.get("slot") or x.get("first") or "-",
                    _kind(x),
                    x.get("id") or "-",
                    x.get("at") or "-",
                    x["state"] or "-",
                )
                for x in lines
            ],
            ["slot (UTC)", "kind", "task id", "sent at", "outcome"],
            keep=(2,),
        )
        if lines
        else f"{name}: no runs yet"
    )
    emit(ctx, lines, text)


def _kind(line: dict[str, Any]) -> str:
    """A history line's kind; a missed line with its count and, when the late slots were
    coalesced into one run, the slot that ran for them."""
    kind = str(line.get("kind") or "-")
    if kind != "missed":
        return kind
    text = f"missed {line.get('count', '?')}"
    if line.get("last") and line.get("last") != line.get("first"):
        text += f" (to {str(line['last'])[11:23]})"
    if line.get("coalesced"):
        text += f", coalesced into {str(line.get('into'))[11:23]}"
    if line.get("at_worker"):
        text += " (held at a worker)"
    return text


@schedule.command("import")
@click.option(
    "--from-redbeat",
    "from_redbeat",
    is_flag=True,
    required=True,
    help="Read celery-redbeat's entries.",
)
@click.option(
    "--redbeat-url",
    help="Where redbeat kept them (default: redbeat_redis_url, else the broker URL).",
)
@click.option("--prefix", help="redbeat's key prefix (default: redbeat_key_prefix or redbeat:).")
@click.option("--replace", is_flag=True, help="Replace entries that already exist.")
@json_option
@click.pass_context
def schedule_import(
    ctx: click.Context,
    from_redbeat: bool,
    redbeat_url: str | None,
    prefix: str | None,
    replace: bool,
    as_json: bool = False,
) -> None:
    """Import celery-redbeat's entries into the schedule (validated like any entry)."""
    import redis

    from celery_baton.beat.api import ScheduleStore
    from celery_baton.beat.redbeat_import import import_redbeat

    c = context_of(ctx)
    conf = c.app.conf
    url = redbeat_url or conf.get("redbeat_redis_url") or conf.broker_url
    key_prefix = prefix or conf.get("redbeat_key_prefix") or "redbeat:"
    try:
        with (
            redis.Redis.from_url(url, decode_responses=True) as client,
            ScheduleStore(c.app, store=c.store) as schedules,
        ):
            report = import_redbeat(client, schedules, prefix=key_prefix, replace=replace)
    except BatonError as exc:
        raise click.ClickException(str(exc)) from exc
    except redis.RedisError as exc:  # redbeat's server (the store's errors are BatonError)
        raise click.ClickException(
            f"cannot read redbeat's entries at {redact_url(url)} (--redbeat-url / "
            f"redbeat_redis_url): {_redis_reason(exc)}"
        ) from exc
    emit(
        ctx,
        {"imported": report.imported, "paused": report.paused, "skipped": report.skipped},
        "\n".join(import_lines(report, url, key_prefix)),
    )


def _redis_reason(exc: Exception) -> str:
    """``connection refused`` for redis-py's ``Error 111 connecting to h:p. Connection
    refused.``; its own words for any other error."""
    text = str(exc)
    if "Connection refused" in text:
        return "connection refused"
    if "Timeout" in type(exc).__name__:
        return "timed out"
    return text.rstrip(".")


def import_lines(report: Any, url: str, key_prefix: str) -> list[str]:
    """What ``schedule import`` prints. When redbeat had no entry at all, where it
    looked: a bare ``imported: nothing`` read the same for a wrong --redbeat-url (the
    broker's database, the default, where redbeat was given its own) as for a redbeat
    that really had none."""
    lines = [f"imported: {', '.join(report.imported) or 'nothing'}"]
    if report.paused:
        lines.append(f"paused (disabled in redbeat): {', '.join(report.paused)}")
    lines += [f"skipped {name}: {why}" for name, why in report.skipped.items()]
    if not report.imported and not report.skipped:
        lines[0] += (
            f" (no redbeat entry under {key_prefix}* at {redact_url(url)}; "
            "--redbeat-url and --prefix name another place)"
        )
    return lines
