"""``celery -A proj baton status | locks | limits | schedule | unlock KEY | web``.

Registered through Celery's ``celery.commands`` entry point. Every command takes
``--json`` (its errors are JSON too); tables fit the terminal's width.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import re
import shutil
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import click

from celery_baton.config import Settings, suggest
from celery_baton.core.rates import interval_us, parse_burst, parse_rate
from celery_baton.errors import BatonError
from celery_baton.ops.web import holders_in_words
from celery_baton.parts import parts_for
from celery_baton.store import Store
from celery_baton.store import inspect as store_inspect


class Context:
    """What every sub-command needs: the app, its settings, the store."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.parts = parts_for(app)
        self.settings: Settings = self.parts.settings
        self.names = self.parts.names

    @functools.cached_property
    def store(self) -> Store:
        # An operator's look never starts an embedded server: with no URL set it reads
        # the one running on this machine, if any.
        return self.parts.connect(client_name="celery-baton-cli", start_embedded=False)

    def live_workers(self) -> set[str]:
        return {r["hostname"] for r in store_inspect.workers(self.store, self.names.prefix)}

    def holders(self) -> list[store_inspect.LeaseRow]:
        """Every lease and unique claim; a lease whose worker stopped reporting is stale."""
        live = self.live_workers()
        rows = [
            dataclasses.replace(row, stale=row.worker not in live)
            for row in store_inspect.leases(self.store, self.names.prefix)
        ]
        return rows + store_inspect.unique_claims(self.store, self.names.prefix)

    def policies(self) -> dict[str, Any]:
        result = {}
        for name, task in sorted(self.app.tasks.items()):
            policy = self.parts.policy_for(task)
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


#: A time as the tables print it (ISO 8601, to the second or finer).
_TIME = re.compile(r"\d{4}-\d\d-\d\d[T ]\d\d:\d\d(:\d\d)?\S*")


def table(
    rows: Sequence[Sequence[Any]],
    headers: Sequence[str],
    width: int | None = None,
    keep: Sequence[int] = (),
) -> str:
    """A plain table; the widest column is cut so the whole fits ``width`` (the
    terminal's, or $COLUMNS; 80 when neither is known), except the columns in ``keep``
    (a key or a task id an operator pastes into a command) and the columns of times:
    a cut one (``2026-11-2…``) says nothing. What is kept may make a line wider."""
    if width is None:
        width = shutil.get_terminal_size((80, 24)).columns
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    times = {
        i
        for i in range(len(headers))
        if any(_TIME.fullmatch(r[i]) for r in cells[1:])
        and all(_TIME.fullmatch(r[i]) or r[i] == "-" for r in cells[1:])
    }
    cuttable = [i for i in range(len(widths)) if i not in keep and i not in times]
    while cuttable and sum(widths) + 2 * (len(widths) - 1) > width:
        widest = max(cuttable, key=lambda i: widths[i])
        if widths[widest] <= 8:
            break
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
        _fail(exc)


def _ctx(ctx: click.Context) -> Context:
    context: Context = ctx.obj["baton"]
    return context


def _fail(exc: BatonError) -> None:
    raise click.ClickException(str(exc)) from exc


watch_option = click.option(
    "--watch",
    type=float,
    default=None,
    metavar="SECONDS",
    help="Print again every SECONDS until interrupted.",
)


def show(ctx: click.Context, render: Callable[[], tuple[Any, str]], watch: float | None) -> None:
    """Print ``render()`` once, or every ``watch`` seconds until Ctrl-C."""
    if not watch:
        try:
            data, text = render()
        except BatonError as exc:
            _fail(exc)
            return
        emit(ctx, data, text)
        return
    if watch < 0.1:
        raise click.BadParameter("must be >= 0.1", param_hint="--watch")
    try:
        while True:
            try:
                data, text = render()
            except BatonError as exc:  # the store went away: say so, keep watching
                data, text = {"error": str(exc)}, f"error: {exc}"
            if not (ctx.obj["json"] or ctx.params.get("as_json")):
                click.clear()
                text = f"{time.strftime('%H:%M:%S')}  every {watch:g}s\n\n{text}"
            emit(ctx, data, text)
            time.sleep(watch)
    except KeyboardInterrupt:
        pass


@baton.command()
@json_option
@watch_option
@click.pass_context
def status(ctx: click.Context, as_json: bool = False, watch: float | None = None) -> None:
    """Store URL, server version, round trip, workers and their leases."""
    c = _ctx(ctx)

    def render() -> tuple[Any, str]:
        store = c.store
        rtts = [store.ping() for _ in range(5)]
        info = store.client.info("server")
        rows = store_inspect.leases(store, c.names.prefix)
        reports = store_inspect.workers(store, c.names.prefix)
        version = info.get("valkey_version") or info.get("redis_version")
        per_worker: dict[str, int] = {}
        for row in rows:
            per_worker[row.worker] = per_worker.get(row.worker, 0) + 1
        live = {r["hostname"] for r in reports}
        stale = sum(1 for row in rows if row.worker not in live)
        data: dict[str, Any] = {
            "store": store.safe_url,
            "embedded": store.embedded,
            "store_from": c.settings.url_source,
            "server": f"{info.get('server_name', 'redis')} {version}",
            "rtt_ms": round(statistics.median(rtts) * 1000, 3),
            "leases": len(rows),
            "stale_leases": stale,
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
        data["grace"] = _grace(c)
        eviction = store_inspect.eviction_warning(store_inspect.eviction_policy(store))
        data["warnings"] = [eviction] if eviction else []
        where = " (embedded: this machine only)" if store.embedded else ""
        if c.settings.url_source == "broker_url":
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
        return data, "\n".join(text)

    show(ctx, render, watch)


def _grace(c: Context) -> str:
    """The store's grace after it lost its data, in words ('' when none is in force)."""
    if c.store.cluster:  # a grace per task family, held by its shard
        graces = store_inspect.family_graces(c.store, c.names.prefix)
        if not graces:
            return ""
        return (
            f"{len(graces)} task(s) on a shard that lost its data or changed master get no "
            f"new lease for up to {max(graces.values()):.1f}s more: {', '.join(sorted(graces))}"
        )
    age = store_inspect.store_epoch_age(c.store, c.names.prefix)
    if age is None:
        return (
            "no store epoch: the next lease waits until the store's start + lease_ttl "
            "(none if it started longer ago; store new or emptied)"
        )
    longest = max([p.lease_ttl for _, p in c.policies().values() if p.gates_runs] or [0.0])
    if age < longest:
        return (
            f"the store started, lost its data or changed master {age:.1f}s ago: no new "
            f"lease until each task's lease_ttl has passed since (up to "
            f"{longest - age:.1f}s more; `end-grace` ends it if the store is new)"
        )
    return ""


@baton.command("end-grace")
@json_option
@click.pass_context
def end_grace(ctx: click.Context, as_json: bool = False) -> None:
    """Grant leases at once on a store that is new or was emptied with no worker
    running: ends the grace (one lease_ttl) a store found without its data gets. Never
    while workers that ran before the loss may still hold runs."""
    c = _ctx(ctx)
    try:
        store_inspect.end_grace(c.store, c.names.prefix)
    except BatonError as exc:
        _fail(exc)
    emit(ctx, {"grace": ""}, "grace ended: new leases are granted at once")


@baton.command()
@json_option
@watch_option
@click.pass_context
def locks(ctx: click.Context, as_json: bool = False, watch: float | None = None) -> None:
    """Live leases and unique claims: key, kind, holder task id, worker, fence, TTL left.

    Keys are printed whole: paste one into `unlock`. A lease whose worker stopped
    reporting is marked stale (it ends when its TTL runs out)."""
    c = _ctx(ctx)

    def render() -> tuple[Any, str]:
        rows = c.holders()
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


@baton.group(invoke_without_command=True)
@json_option
@watch_option
@click.pass_context
def limits(ctx: click.Context, as_json: bool = False, watch: float | None = None) -> None:
    """Configured limits, runtime overrides, held requests and concurrency holders."""
    if ctx.invoked_subcommand is not None:
        return
    c = _ctx(ctx)

    def render() -> tuple[Any, str]:
        policies = c.policies()
        rows = store_inspect.leases(c.store, c.names.prefix)
        reports = store_inspect.workers(c.store, c.names.prefix)
        data: dict[str, Any] = {"tasks": [], "workers": reports}
        for name, (task, policy) in policies.items():
            overrides = store_inspect.limit_overrides(c.store, c.names.limits(name))
            rate = None
            if policy.rate:
                rate = f"{policy.rate.per_second:g}/s burst {policy.rate.burst}"
                for more in policy.more_rates:  # decided in the same call
                    rate += f" + {more.per_second:g}/s"
            elif policy.rate_from_celery and task.rate_limit:
                rate = f"{task.rate_limit} (Celery rate_limit, global)"
            if policy.shared:  # named limits, decided in the same call
                named = " + ".join(f"[{limit.name}]" for limit in policy.shared)
                rate = f"{rate} + {named}" if rate else named
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
        data["named_limits"] = _named_limits(c, policies)
        if data["named_limits"]:
            text += "\n\n" + table(
                [
                    (n["limit"], n["rate"], n["burst"], f"{n['penalty_left']:.1f}s", n["tasks"])
                    for n in data["named_limits"]
                ],
                ["named limit", "rate", "burst", "penalty", "tasks"],
                keep=(0,),
            )
        if reports:
            text += "\n\n" + table(
                [
                    (r["hostname"], r.get("held", 0), r.get("admitted", 0), r.get("throttled", 0))
                    for r in reports
                ],
                ["worker", "held", "admitted", "throttled"],
                keep=(0,),
            )
        return data, text

    show(ctx, render, watch)


def _named_limits(c: Context, policies: dict[str, Any]) -> list[dict[str, Any]]:
    """``baton_limits``: each limit, its penalty left, and the tasks that draw from it."""
    from celery_baton.core.shared_limits import parse_limits

    rows = []
    for name, limit in parse_limits(c.settings.limits).items():
        users = [t for t, (_, p) in policies.items() if limit in p.shared]
        rows.append(
            {
                "limit": name,
                "rate": f"{limit.per_second:g}/s",
                "burst": limit.burst,
                "penalty_left": store_inspect.penalty_left(c.store, c.names.shared_penalty(name)),
                "tasks": len(users),
            }
        )
    return rows


def _limited_task(c: Context, task: str, *, rate: bool, concurrency: bool) -> None:
    """``limits set`` changes a limit the task declares, on a task that exists: anything
    else is a typo that would silently do nothing (exit status 2)."""
    if "." not in task:
        raise click.UsageError(
            f"{task!r} is not a full task name; use the name with its module "
            "(as `celery inspect registered` shows it)"
        )
    found = c.app.tasks.get(task)
    if found is None:
        hint = suggest(task, [n for n in c.app.tasks if not n.startswith("celery.")])
        raise click.UsageError(f"no task named {task!r} in this app{hint}")
    policy = c.policies().get(task, (None, None))[1]
    if rate and not (policy and (policy.rate or policy.rate_from_celery)):
        raise click.UsageError(
            f"{task} declares no global rate (global_rate_limit, or rate_limit with "
            "baton_global_rate_limits): --rate would change nothing"
        )
    if concurrency and not (policy and policy.concurrency):
        raise click.UsageError(
            f"{task} declares no global_concurrency: --concurrency would change nothing"
        )


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
    """Change TASK's limits at runtime, for every worker (kept in the store).

    TASK is the full task name; only a limit the task declares can be changed."""
    c = _ctx(ctx)
    if rate is None and concurrency is None:
        raise click.UsageError("give --rate and/or --concurrency")
    _limited_task(c, task, rate=rate is not None, concurrency=concurrency is not None)
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

    c = _ctx(ctx)

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
                    flags + (" paused" if e.get("paused") else ""),
                )
            )
        text += "\n\n" + (
            table(rows, ["entry", "next slot (UTC)", "last slot", "task id", "policy"], keep=(0,))
            if rows
            else "no entries"
        )
        if data.get("refused"):
            text += "\n\nrefused: " + ", ".join(f"{k} ({v})" for k, v in data["refused"].items())
        return data, text

    show(ctx, render, watch)


@baton.command()
@click.argument("key")
@click.option("--force", is_flag=True, help="Free it even if a live run holds it.")
@json_option
@click.pass_context
def unlock(ctx: click.Context, key: str, force: bool, as_json: bool = False) -> None:
    """Free lease or unique claim KEY (as shown by `locks`); refuses a live holder
    unless --force."""
    c = _ctx(ctx)
    try:
        if not store_inspect.exists(c.store, key):
            raise click.ClickException(f"{key}: no such lease or unique claim (see `locks`)")
        live_workers = c.live_workers()
        words = store_inspect.label(c.store, key)
        removed, live = store_inspect.unlock(
            c.store, key, force=force, channel=c.names.notice_channel
        )
    except BatonError as exc:
        _fail(exc)
        return
    named = f"{key} ({words})" if words else key
    if live and not force:
        raise click.ClickException(
            f"{named} {holders_in_words(live, live_workers)}. Use --force to free it."
        )
    emit(
        ctx,
        {"key": key, "label": words, "removed": removed, "was_live": live},
        f"{named}: {removed} holder(s) removed",
    )


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
    help="Enables the actions (unlock, pause, resume, trigger) for whoever gives it "
    "[env: BATON_WEB_TOKEN]. Without it the page is read-only.",
)
@click.option("--refresh", type=float, default=5.0, show_default=True, help="Seconds.")
@click.pass_context
def web(ctx: click.Context, host: str, port: int, token: str | None, refresh: float) -> None:
    """Serve the web view: workers, leases, unique claims, limits, schedule; the CLI's
    actions behind --token; /api/state (JSON) and /metrics (Prometheus, every worker)."""
    from celery_baton.beat.api import ScheduleStore
    from celery_baton.ops.web import TOKEN_CHARS, serve

    c = _ctx(ctx)
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
        _fail(exc)

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
        )
    except OSError as exc:  # the port is taken, or the address is not this host's
        raise click.ClickException(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}"
        ) from exc


def _schedule_action(ctx: click.Context, name: str, action: str, done: str) -> None:
    from celery_baton.beat.api import ScheduleStore

    c = _ctx(ctx)
    try:
        with ScheduleStore(c.app, store=c.store) as api:
            getattr(api, action)(name)
    except BatonError as exc:
        _fail(exc)
    emit(ctx, {"entry": name, action: True}, f"{name}: {done}")


@schedule.command("pause")
@click.argument("name")
@json_option
@click.pass_context
def schedule_pause(ctx: click.Context, name: str, as_json: bool = False) -> None:
    """Stop firing entry NAME until `resume`."""
    _schedule_action(ctx, name, "pause", "paused")


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
    _schedule_action(ctx, name, "trigger", "one extra run requested")


@schedule.command("history")
@click.argument("name")
@json_option
@click.pass_context
def schedule_history(ctx: click.Context, name: str, as_json: bool = False) -> None:
    """The last runs of entry NAME: slot, task id, when it was sent, and the outcome
    when a result backend has it."""
    from celery_baton.beat.api import describe_schedule
    from celery_baton.beat.state import schedule_name

    c = _ctx(ctx)
    try:
        data = describe_schedule(c.store, c.names.prefix, app=schedule_name(c.app.main))
    except BatonError as exc:
        _fail(exc)
        return
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
                    x.get("slot") or "-",
                    x.get("kind") or "-",
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

    c = _ctx(ctx)
    conf = c.app.conf
    url = redbeat_url or conf.get("redbeat_redis_url") or conf.broker_url
    key_prefix = prefix or conf.get("redbeat_key_prefix") or "redbeat:"
    try:
        with (
            redis.Redis.from_url(url, decode_responses=True) as client,
            ScheduleStore(c.app, store=c.store) as schedules,
        ):
            report = import_redbeat(client, schedules, prefix=key_prefix, replace=replace)
    except (BatonError, redis.RedisError) as exc:
        raise click.ClickException(str(exc)) from exc
    lines = [f"imported: {', '.join(report.imported) or 'nothing'}"]
    if report.paused:
        lines.append(f"paused (disabled in redbeat): {', '.join(report.paused)}")
    lines += [f"skipped {name}: {why}" for name, why in report.skipped.items()]
    emit(
        ctx,
        {"imported": report.imported, "paused": report.paused, "skipped": report.skipped},
        "\n".join(lines),
    )
