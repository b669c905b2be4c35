"""What every command prints: a table that fits the terminal, JSON under ``--json``,
and ``--watch`` (print again every few seconds)."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import click

from celery_baton.errors import BatonError

#: A time as the tables print it (ISO 8601, to the second or finer).
_TIME = re.compile(r"\d{4}-\d\d-\d\d[T ]\d\d:\d\d(:\d\d)?\S*")


def table(
    rows: Sequence[Sequence[Any]],
    headers: Sequence[str],
    width: int | None = None,
    keep: Sequence[int] = (),
) -> str:
    """A plain table; the widest column is cut so the whole fits ``width`` ($COLUMNS, or
    the terminal's; nothing is cut when stdout is not a terminal and $COLUMNS is not
    set: ``baton schedule | cat`` or ``> file`` gets every cell whole), never below its
    header, except the columns in ``keep`` (a key or a task id an operator pastes into a
    command) and the columns of times: a cut one (``2026-11-2…``) says nothing. What is
    kept may make a line wider."""
    if width is None:
        width = _width()
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    times = {
        i
        for i in range(len(headers))
        if any(_TIME.fullmatch(r[i]) for r in cells[1:])
        and all(_TIME.fullmatch(r[i]) or r[i] == "-" for r in cells[1:])
    }
    # A column is never cut below its header (nor 8): ``fired /…`` and ``skip/al…`` said
    # nothing, while the line still wrapped on a kept task id.
    floors = [max(8, len(str(h))) for h in headers]
    cuttable = [i for i in range(len(widths)) if i not in keep and i not in times]
    while width is not None and cuttable and sum(widths) + 2 * (len(widths) - 1) > width:
        widest = max(cuttable, key=lambda i: widths[i] - floors[i])
        if widths[widest] <= floors[widest]:
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


def _width() -> int | None:
    """The width a table fits: $COLUMNS when set, else the terminal's; None (no cut)
    when stdout is a pipe or a file (before, cut to 80 there too: ``skip/al…``)."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    if not sys.stdout.isatty():
        return None
    return shutil.get_terminal_size((80, 24)).columns


def emit(ctx: click.Context, data: Any, text: str) -> None:
    as_json = ctx.obj["json"] or ctx.params.get("as_json")
    click.echo(json.dumps(data, indent=2, default=str) if as_json else text)


json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON.")


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
            fail(exc)
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


def fail(exc: BatonError) -> NoReturn:
    """A store or settings error: one line (``Error: ...``, or JSON), not a traceback."""
    raise click.ClickException(str(exc)) from exc
