"""``baton limits`` (each task's global limits, runtime overrides, named limits, what
the workers hold), ``baton limits set TASK`` and ``baton limits clear TASK``."""

from __future__ import annotations

from typing import Any

import click

from celery_baton.core.rates import interval_us, parse_burst, parse_rate, rate_text
from celery_baton.errors import BatonError
from celery_baton.ops import state
from celery_baton.ops.cli.group import Context, baton, context_of
from celery_baton.ops.cli.output import emit, fail, json_option, show, table, watch_option
from celery_baton.store import inspect as store_inspect
from celery_baton.store.schema import rate_override


@baton.group(invoke_without_command=True)
@json_option
@watch_option
@click.pass_context
def limits(ctx: click.Context, as_json: bool = False, watch: float | None = None) -> None:
    """Configured limits, runtime overrides, held requests and concurrency holders."""
    if ctx.invoked_subcommand is not None:
        return
    c = context_of(ctx)

    def render() -> tuple[Any, str]:
        policies = c.policies()
        rows = store_inspect.leases(c.store, c.names.prefix)
        reports = store_inspect.workers(c.store, c.names.prefix)
        data: dict[str, Any] = {
            "tasks": [
                {
                    "task": t.task,
                    "rate": t.declared_rate,
                    "concurrency": t.declared_concurrency,
                    "overrides": t.overrides,
                    "concurrency_holders": [r.as_dict() for r in t.holders],
                }
                for t in state.task_limits(c, rows)
            ],
            "workers": reports,
        }
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
        data["named_limits"] = state.named_limits(c, policies)
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


def describe_overrides(overrides: dict[str, str]) -> str:
    """``{"rate": "500000 2"}`` -> ``"rate 2/s burst 2"``: what an operator typed."""
    parts = []
    if "rate" in overrides:
        per_second, burst = state.override_rate(overrides["rate"])
        parts.append(f"rate {rate_text(per_second)} burst {burst}")
    if "concurrency" in overrides:
        parts.append(f"concurrency {overrides['concurrency']}")
    return ", ".join(parts)


def _limited_task(c: Context, task: str, *, rate: bool, concurrency: bool) -> None:
    """``limits set`` changes a limit the task declares, on a task that exists: anything
    else is a typo that would silently do nothing (exit status 2)."""
    if "." not in task and task not in c.app.tasks:
        # The function's name (`fetch` for proj.tasks.fetch): name the full one, as
        # `unlock --task` does, rather than send the operator to `celery inspect`.
        full = sorted(c.tasks_named(task))
        hint = f"; did you mean {' or '.join(full)}?" if full else ""
        raise click.UsageError(
            f"{task!r} is not a full task name; use the name with its module "
            f"(as `celery inspect registered` shows it){hint}"
        )
    found = c.app.tasks.get(task)
    if found is None:
        raise click.UsageError(f"no task named {task!r} in this app{c.near_tasks(task)}")
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
@click.option(
    "--burst",
    type=int,
    default=None,
    help="Burst of the new rate (default: the burst the task declares, else 1).",
)
@click.option("--concurrency", type=int, help="New global concurrency limit.")
@json_option
@click.pass_context
def limits_set(
    ctx: click.Context,
    task: str,
    rate: str | None,
    burst: int | None,
    concurrency: int | None,
    as_json: bool = False,
) -> None:
    """Change TASK's limits at runtime, for every worker (kept in the store).

    TASK is the full task name; only a limit the task declares can be changed."""
    c = context_of(ctx)
    if rate is None and concurrency is None:
        raise click.UsageError("give --rate and/or --concurrency")
    _limited_task(c, task, rate=rate is not None, concurrency=concurrency is not None)
    if rate is not None and burst is None:
        # The declared burst, kept: a new rate alone set burst 1 before (the gate's "O"
        # override replaces both the interval and the burst of the rate it precedes).
        policy = c.policies()[task][1]
        burst = policy.rate.burst if policy.rate else 1
    try:
        key = c.names.limits(task)
        if rate is not None:
            value = rate_override(interval_us(parse_rate(rate, subject=task)), parse_burst(burst))
            store_inspect.set_limit_override(c.store, key, "rate", value)
        if concurrency is not None:
            if concurrency < 1:
                raise click.BadParameter("must be >= 1", param_hint="--concurrency")
            store_inspect.set_limit_override(c.store, key, "concurrency", str(concurrency))
    except BatonError as exc:
        fail(exc)
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
    c = context_of(ctx)
    try:
        for field in ("rate", "concurrency"):
            store_inspect.set_limit_override(c.store, c.names.limits(task), field, None)
    except BatonError as exc:
        fail(exc)
    emit(ctx, {"task": task, "cleared": True}, f"{task}: runtime overrides cleared")
