"""``celery -A proj baton status | locks | limits | schedule | unlock KEY``.

Registered through Celery's ``celery.commands`` entry point. Every command takes
``--json``; tables fit an 80-column terminal.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from typing import Any

import click

from celery_baton.config import Settings, read_settings
from celery_baton.errors import BatonError
from celery_baton.keys import KeyNames
from celery_baton.rates import interval_us, parse_burst, parse_rate
from celery_baton.store import Store, connect
from celery_baton.store import inspect as store_inspect


class Context:
    """What every sub-command needs: the app, its settings, the store."""

    def __init__(self, app: Any) -> None:
        self.app = app
        from celery_baton.baton import baton_for

        baton = baton_for(app)
        self.settings: Settings = baton.settings if baton else read_settings(app.conf)
        self.names = KeyNames(self.settings.key_prefix)
        self._store: Store | None = baton.store if baton else None

    @property
    def store(self) -> Store:
        if self._store is None:
            self._store = connect(self.settings.url, socket_timeout=self.settings.socket_timeout)
        return self._store

    def policies(self) -> dict[str, Any]:
        from celery_baton.policy import compile_policy

        result = {}
        for name, task in sorted(self.app.tasks.items()):
            policy = compile_policy(name, _reader(task), task.run, self.settings)
            if policy is not None:
                result[name] = (task, policy)
        return result


def describe_overrides(overrides: dict[str, str]) -> str:
    """``{"rate": "500000 2"}`` -> ``"rate 2/s burst 2"``: what an operator typed."""
    parts = []
    if "rate" in overrides:
        interval, _, burst = overrides["rate"].partition(" ")
        parts.append(f"rate {1_000_000 / int(interval):g}/s burst {burst or 1}")
    if "concurrency" in overrides:
        parts.append(f"concurrency {overrides['concurrency']}")
    return ", ".join(parts)


def _reader(task: Any) -> Any:
    return lambda option: getattr(task, option, None)


def table(rows: Sequence[Sequence[Any]], headers: Sequence[str], width: int = 80) -> str:
    """A plain table; the widest column is cut so the whole fits ``width``."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    while sum(widths) + 2 * (len(widths) - 1) > width and max(widths) > 8:
        widest = widths.index(max(widths))
        widths[widest] -= 1
    lines = []
    for n, row in enumerate(cells):
        parts = []
        for text, w in zip(row, widths, strict=True):
            parts.append(text if len(text) <= w else text[: w - 1] + "…")
        lines.append("  ".join(p.ljust(w) for p, w in zip(parts, widths, strict=True)).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def emit(ctx: click.Context, data: Any, text: str) -> None:
    as_json = ctx.obj["json"] or ctx.params.get("as_json")
    click.echo(json.dumps(data, indent=2, default=str) if as_json else text)


json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON.")


@click.group(name="baton")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
@click.pass_context
def baton(ctx: click.Context, as_json: bool = False) -> None:
    """celery-baton: leases, limits and the beat schedule in the store."""
    app = ctx.obj.app if ctx.obj is not None and hasattr(ctx.obj, "app") else None
    if app is None:
        raise click.UsageError("run as: celery -A proj baton ...")
    ctx.obj = {"baton": Context(app), "json": as_json}


def _ctx(ctx: click.Context) -> Context:
    context: Context = ctx.obj["baton"]
    return context


def _fail(exc: BatonError) -> None:
    raise click.ClickException(str(exc)) from exc


@baton.command()
@json_option
@click.pass_context
def status(ctx: click.Context, as_json: bool = False) -> None:
    """Store URL, server version, round trip, workers and their leases."""
    c = _ctx(ctx)
    try:
        store = c.store
        rtts = [store.ping() for _ in range(5)]
        info = store.client.info("server")
        rows = store_inspect.leases(store, c.names.prefix)
        reports = store_inspect.workers(store, c.names.prefix)
    except BatonError as exc:
        _fail(exc)
        return
    version = info.get("valkey_version") or info.get("redis_version")
    per_worker: dict[str, int] = {}
    for row in rows:
        per_worker[row.worker] = per_worker.get(row.worker, 0) + 1
    data: dict[str, Any] = {
        "store": store.safe_url,
        "embedded": store.embedded,
        "server": f"{info.get('server_name', 'redis')} {version}",
        "rtt_ms": round(statistics.median(rtts) * 1000, 3),
        "leases": len(rows),
        "workers": [
            {
                "hostname": r["hostname"],
                "leases": per_worker.get(r["hostname"], 0),
                "held": r.get("held", 0),
                "admitted": r.get("admitted", 0),
            }
            for r in reports
        ],
    }
    text = [
        f"store:    {data['store']}{' (embedded: this machine only)' if store.embedded else ''}",
        f"server:   {data['server']}",
        f"rtt:      {data['rtt_ms']} ms",
        f"leases:   {data['leases']}",
        "",
        table(
            [(w["hostname"], w["leases"], w["held"], w["admitted"]) for w in data["workers"]],
            ["worker", "leases", "held", "admitted"],
        )
        if data["workers"]
        else "no live workers",
    ]
    emit(ctx, data, "\n".join(text))


@baton.command()
@json_option
@click.pass_context
def locks(ctx: click.Context, as_json: bool = False) -> None:
    """Live leases: key, holder task id, worker, fence, TTL left."""
    c = _ctx(ctx)
    try:
        rows = store_inspect.leases(c.store, c.names.prefix)
    except BatonError as exc:
        _fail(exc)
        return
    emit(
        ctx,
        [r.as_dict() for r in rows],
        table(
            [(r.key, r.task_id[:8], r.worker, r.fence, f"{r.ttl_left:.1f}s") for r in rows],
            ["key", "task id", "worker", "fence", "ttl"],
        )
        if rows
        else "no live leases",
    )


@baton.group(invoke_without_command=True)
@json_option
@click.pass_context
def limits(ctx: click.Context, as_json: bool = False) -> None:
    """Configured limits, runtime overrides, held requests and concurrency holders."""
    if ctx.invoked_subcommand is not None:
        return
    c = _ctx(ctx)
    try:
        policies = c.policies()
        rows = store_inspect.leases(c.store, c.names.prefix)
        reports = store_inspect.workers(c.store, c.names.prefix)
        data: dict[str, Any] = {"tasks": [], "workers": reports}
        for name, (task, policy) in policies.items():
            overrides = store_inspect.limit_overrides(c.store, c.names.limits(name))
            rate = None
            if policy.rate:
                rate = f"{policy.rate.per_second:g}/s burst {policy.rate.burst}"
            elif policy.rate_from_celery and task.rate_limit:
                rate = f"{task.rate_limit} (Celery rate_limit, global)"
            holders = [r.as_dict() for r in rows if r.task == name and r.kind == "concurrency"]
            data["tasks"].append(
                {
                    "task": name,
                    "rate": rate,
                    "concurrency": policy.concurrency.limit if policy.concurrency else None,
                    "overrides": overrides,
                    "concurrency_holders": holders,
                }
            )
    except BatonError as exc:
        _fail(exc)
        return
    tasks = [t for t in data["tasks"] if t["rate"] or t["concurrency"]]
    text = (
        table(
            [
                (
                    t["task"],
                    t["rate"] or "-",
                    t["concurrency"] or "-",
                    describe_overrides(t["overrides"]) or "-",
                    len(t["concurrency_holders"]),
                )
                for t in tasks
            ],
            ["task", "rate", "conc", "override", "running"],
        )
        if tasks
        else "no task has a global limit"
    )
    if reports:
        text += "\n\n" + table(
            [
                (r["hostname"], r.get("held", 0), r.get("admitted", 0), r.get("throttled", 0))
                for r in reports
            ],
            ["worker", "held", "admitted", "throttled"],
        )
    emit(ctx, data, text)


@limits.command("set")
@click.argument("task")
@click.option("--rate", help="New global rate for all workers, e.g. 5/s.")
@click.option("--burst", type=int, default=1, show_default=True)
@click.option("--concurrency", type=int, help="New global concurrency limit.")
@json_option
@click.pass_context
def limits_set(
    ctx: click.Context,
    task: str,
    rate: str | None,
    burst: int,
    concurrency: int | None,
    as_json: bool = False,
) -> None:
    """Change TASK's limits at runtime, for every worker (kept in the store)."""
    c = _ctx(ctx)
    if rate is None and concurrency is None:
        raise click.UsageError("give --rate and/or --concurrency")
    try:
        key = c.names.limits(task)
        if rate is not None:
            value = f"{interval_us(parse_rate(rate, subject=task))} {parse_burst(burst)}"
            store_inspect.set_limit_override(c.store, key, "rate", value)
        if concurrency is not None:
            if concurrency < 1:
                raise click.BadParameter("must be >= 1", param_hint="--concurrency")
            store_inspect.set_limit_override(c.store, key, "concurrency", str(concurrency))
    except BatonError as exc:
        _fail(exc)
    emit(
        ctx,
        {"task": task, "rate": rate, "burst": burst, "concurrency": concurrency},
        f"{task}: limits updated for all workers",
    )


@limits.command("clear")
@click.argument("task")
@json_option
@click.pass_context
def limits_clear(ctx: click.Context, task: str, as_json: bool = False) -> None:
    """Drop TASK's runtime overrides: its declared limits apply again."""
    c = _ctx(ctx)
    try:
        for field in ("rate", "concurrency"):
            store_inspect.set_limit_override(c.store, c.names.limits(task), field, None)
    except BatonError as exc:
        _fail(exc)
    emit(ctx, {"task": task, "cleared": True}, f"{task}: runtime overrides cleared")


@baton.command()
@json_option
@click.pass_context
def schedule(ctx: click.Context, as_json: bool = False) -> None:
    """The beat schedule: next and last slot per entry, the leader, recent history."""
    from celery_baton.beat.api import describe_schedule
    from celery_baton.beat.state import schedule_name

    c = _ctx(ctx)
    try:
        # The keys of this app's beat (its app.main), not another project's on the store.
        data = describe_schedule(c.store, c.names.prefix, app=schedule_name(c.app.main))
    except BatonError as exc:
        _fail(exc)
        return
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
                (e.get("last_id") or "-")[:8],
                flags + (" paused" if e.get("paused") else ""),
            )
        )
    text += "\n\n" + (
        table(rows, ["entry", "next slot (UTC)", "last slot", "task id", "policy"])
        if rows
        else "no entries"
    )
    if data.get("refused"):
        text += "\n\nrefused: " + ", ".join(f"{k} ({v})" for k, v in data["refused"].items())
    emit(ctx, data, text)


@baton.command()
@click.argument("key")
@click.option("--force", is_flag=True, help="Free it even if a live run holds it.")
@json_option
@click.pass_context
def unlock(ctx: click.Context, key: str, force: bool, as_json: bool = False) -> None:
    """Free lease KEY (as shown by `locks`); refuses a live lease unless --force."""
    c = _ctx(ctx)
    try:
        removed, live = store_inspect.unlock(
            c.store, key, force=force, channel=c.names.notice_channel
        )
    except BatonError as exc:
        _fail(exc)
        return
    if live and not force:
        holders = ", ".join(f"task {o.split('|')[0]} on {o.split('|')[1]}" for o in live)
        raise click.ClickException(
            f"{key} is held by a live run ({holders}); it is renewed while that run lives. "
            "Use --force to free it anyway."
        )
    emit(
        ctx,
        {"key": key, "removed": removed, "was_live": live},
        f"{key}: {removed} holder(s) removed",
    )
