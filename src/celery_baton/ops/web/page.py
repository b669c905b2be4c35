"""The web view's HTML: one server-rendered page (workers, leases, unique claims, ordered
keys, batches, limits, the beat schedule) from the read model's state, and the 403 page."""

from __future__ import annotations

import html
from collections.abc import Mapping
from typing import Any

from celery_baton.core.rates import rate_text
from celery_baton.ops.state import gap_words

_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.3em;margin:0 0 .2em} h2{font-size:1.05em;margin:1.4em 0 .4em}
table{border-collapse:collapse;width:100%} th,td{text-align:left;padding:.25em .6em;
border-bottom:1px solid #ddd;vertical-align:top} th{background:#f4f4f4}
code{font-size:12px;word-break:break-all} .muted{color:#777}
.words{font-size:12px;color:#335}
.stale{background:#fff1e0} .tag{font-weight:bold;color:#b35c00}
.note{padding:.5em .8em;background:#eef6ff;border:1px solid #9cc3ee;margin:.6em 0}
.note.error{background:#fff0f0;border-color:#e3a0a0}
form.inline{display:inline;margin:0 .3em 0 0} button{font-size:12px}
header{display:flex;justify-content:space-between;align-items:flex-start;gap:1em}
"""

# Reload unless the operator is typing or has ticked a box (a reload would undo it).
_SCRIPT = """
setInterval(function(){
  if(document.querySelector('input:focus,input[type=checkbox]:checked'))return;
  location.replace(location.pathname);
}, %d);
"""


def render_page(
    state: Mapping[str, Any],
    *,
    actions: bool,
    signed_in: bool,
    refresh: float,
    note: str = "",
    error: str = "",
    outage: str = "",
) -> str:
    """The HTML page. ``actions``: the server has a token; ``signed_in``: this browser
    sent it (only then are the controls shown: a read-only visitor gets nothing to
    click that would end in a 403). ``outage``: the store did not answer; ``state`` is
    then the last one read (or an empty one) and the page says so, and keeps
    refreshing until the store is back."""
    e = html.escape
    controls = actions and signed_in
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        "<title>celery-baton</title>",
        f"<noscript><meta http-equiv='refresh' content='{refresh:g};url=/'></noscript>",
        f"<style>{_STYLE}</style></head><body><header><div>",
        "<h1>celery-baton</h1>",
        f"<div class='muted'>store <code>{e(state['store'])}</code> · {e(state['time'])}"
        f" · refreshes every {refresh:g}s · <a href='/api/state'>JSON</a>"
        " · <a href='/metrics'>metrics</a></div></div>",
        _auth_box(actions=actions, signed_in=signed_in),
        "</header>",
    ]
    if note:
        parts.append(f"<div class='note' id='note'>{e(note)}</div>")
    if error:
        parts.append(f"<div class='note error' id='note'>{e(error)}</div>")
    if outage:
        parts.append(f"<div class='note error' id='outage'>{e(outage)}</div>")
    parts.append(_workers(state["workers"]))
    parts.append(_leases(state["leases"], actions=controls))
    parts.append(_claims(state["unique_claims"], actions=controls))
    parts.append(_ordered(state.get("ordered", [])))
    parts.append(_batches(state.get("batches", [])))
    parts.append(_limits_table(state["limits"]))
    parts.append(_schedule(state["schedule"], actions=controls))
    if controls:
        parts.append(_cancel_form())
    parts.append(f"<script>{_SCRIPT % int(refresh * 1000)}</script></body></html>")
    return "".join(parts)


def _auth_box(*, actions: bool, signed_in: bool) -> str:
    if not actions:
        return "<div class='muted' id='auth'>read-only: started without a token</div>"
    if signed_in:
        return (
            "<form method='post' action='/logout' id='auth'>actions enabled "
            "<button type='submit'>sign out</button></form>"
        )
    return (
        "<form method='post' action='/login' id='auth'>"
        "<input type='password' name='token' placeholder='token' autocomplete='off'> "
        "<button type='submit'>sign in</button>"
        "<div class='muted'>read-only until signed in</div></form>"
    )


def _table(headers: list[str], rows: list[str], empty: str) -> str:
    if not rows:
        return f"<p class='muted'>{empty}</p>"
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>"


def _cells(*values: Any) -> str:
    return "".join(f"<td>{v}</td>" for v in values)


def _action_form(action: str, field: str, value: str, label: str, *, force: bool = False) -> str:
    e = html.escape
    tick = "<label><input type='checkbox' name='force' value='1'> force</label> " if force else ""
    return (
        f"<form class='inline' method='post' action='/action'>"
        f"<input type='hidden' name='action' value='{action}'>"
        f"<input type='hidden' name='{field}' value='{e(value)}'>{tick}"
        f"<button type='submit' name='do' value='{action}'>{label}</button></form>"
    )


def _cancel_form() -> str:
    """``baton.cancel`` (signed in only): a task id, or a task and its key as JSON."""
    return (
        "<h2>Cancel</h2><form method='post' action='/action' id='cancel'>"
        "<input type='hidden' name='action' value='cancel'>"
        "<input name='task_id' placeholder='task id' size='38'> or "
        "<input name='task' placeholder='task name' size='28'> "
        "<input name='key' placeholder='key JSON: {\"account_id\": 7}' size='26'> "
        "<label><input type='checkbox' name='terminate' value='1'> terminate</label> "
        "<button type='submit' name='do' value='cancel'>cancel</button></form>"
        "<p class='muted'>A cancelled call never starts on any worker, also one started "
        "later; its result is REVOKED.</p>"
    )


def _workers(workers: list[dict[str, Any]]) -> str:
    rows = []
    for w in workers:
        expires = w.get("expires_in")
        rows.append(
            f"<tr data-worker='{html.escape(w.get('hostname', ''))}'>"
            + _cells(
                html.escape(w.get("hostname", "")),
                w.get("held", 0),
                # The store's count, now: the report's own is as old as the report.
                w.get("leases_in_store", w.get("leases", 0)),
                w.get("admitted", 0),
                w.get("skipped", 0),
                w.get("throttled", 0),
                w.get("handed_back", 0),
                f"{w.get('renewals', 0)} / {w.get('losses', 0)}",
                "-" if expires is None else f"{expires:.1f}s",
            )
            + "</tr>"
        )
    return "<h2 id='workers'>Workers</h2>" + _table(
        [
            "worker",
            "held now",
            "leases",
            "admitted",
            "skipped",
            "throttled",
            "handed back",
            "renewals / losses",
            "report expires in",
        ],
        rows,
        "no live workers (none reported to the store within its report ttl)",
    )


def _leases(leases: list[dict[str, Any]], *, actions: bool) -> str:
    e = html.escape
    rows = []
    for r in leases:
        stale = r["stale"]
        worker = e(r["worker"]) + (" <span class='tag'>STALE</span>" if stale else "")
        control = _action_form("unlock", "key", r["key"], "unlock", force=True) if actions else ""
        rows.append(
            f"<tr class='{'stale' if stale else 'live'}' data-key='{e(r['key'])}'>"
            + _cells(
                f"<code>{e(r['key'])}</code>"
                + (f"<div class='words'>{e(r['label'])}</div>" if r.get("label") else ""),
                e(r["kind"]),
                f"<code>{e(r['task_id'])}</code>",
                worker,
                r["fence"] or "-",
                f"{r['ttl_left']:.1f}s",
                control,
            )
            + "</tr>"
        )
    text = _table(
        ["key", "kind", "task id", "worker", "fence", "ttl left", ""], rows, "no live leases"
    )
    if any(r["stale"] for r in leases):
        text += (
            "<p class='muted'>STALE: the worker stopped reporting; the lease ends when its "
            "ttl runs out, or unlock it with force.</p>"
        )
    return "<h2 id='leases'>Leases</h2>" + text


def _claims(claims: list[dict[str, Any]], *, actions: bool) -> str:
    e = html.escape
    rows = [
        f"<tr data-key='{e(r['key'])}'>"
        + _cells(
            f"<code>{e(r['key'])}</code>",
            f"<code>{e(r['task_id'])}</code>",
            f"{r['ttl_left']:.0f}s",
            _action_form("unlock", "key", r["key"], "unlock", force=True) if actions else "",
        )
        + "</tr>"
        for r in claims
    ]
    return "<h2 id='claims'>Unique claims</h2>" + _table(
        ["key", "held by task id (queued or running)", "ttl left", ""], rows, "no unique claims"
    )


def _key_cell(entry: Mapping[str, Any]) -> str:
    """A key whole, with its words below it (as a lease's)."""
    e = html.escape
    words = f"<div class='words'>{e(entry['label'])}</div>" if entry.get("label") else ""
    return f"<code>{e(entry['key'])}</code>{words}"


def _ordered(entries: list[dict[str, Any]]) -> str:
    e = html.escape
    rows = []
    for o in entries:
        running = o["running"]
        if running is not None:
            stale = " <span class='tag'>STALE</span>" if running["stale"] else ""
            now = (
                f"task <code>{e(running['task_id'])}</code> on {e(running['worker'])}{stale}"
                f" (ttl {running['ttl_left']:.1f}s)"
            )
        else:
            now = f"<span class='muted'>{o['next']} {e(gap_words(o))}</span>"
        queued = str(o["queued"]) + (f" ({o['held']} held in workers)" if o["held"] else "")
        rows.append(
            f"<tr data-key='{e(o['key'])}'>"
            + _cells(_key_cell(o), o["next"], now, queued)
            + "</tr>"
        )
    return "<h2 id='ordered'>Ordered keys</h2>" + _table(
        ["key", "next", "running", "queued behind it"],
        rows,
        "no ordered key has a call running or queued",
    )


def _batches(entries: list[dict[str, Any]]) -> str:
    e = html.escape
    rows = []
    for b in entries:
        runs = []
        for run in b["runs"]:
            stale = " <span class='tag'>STALE</span>" if run["stale"] else ""
            runs.append(
                f"{run['calls']} calls on {e(run['worker'])}{stale} for {run['age']:.1f}s"
                f" (ttl {run['ttl_left']:.1f}s)"
            )
        due = b["due_in"]
        rows.append(
            f"<tr data-key='{e(b['key'])}'>"
            + _cells(
                _key_cell(b),
                b["waiting"],
                f"{b['oldest']:.1f}s" if b["waiting"] else "-",
                "-" if due is None else ("due now" if due <= 0 else f"in {due:.1f}s"),
                "<br>".join(runs) or "-",
            )
            + "</tr>"
        )
    return "<h2 id='batches'>Batches</h2>" + _table(
        ["key", "calls waiting", "oldest waiting", "next batch", "running"],
        rows,
        "no batch key has calls waiting or a batch running",
    )


def _limits_table(limits: list[dict[str, Any]]) -> str:
    e = html.escape
    rows = []
    for t in limits:
        rate, conc = t["rate"], t["concurrency"]
        rate_shown = use_text = "-"
        if rate:
            rate_shown = f"{rate_text(rate['per_second'])} burst {rate['burst']}"
            use_text = (
                f"{rate['burst_in_use']:g} of {rate['burst']} in use"
                + (f", next start in {rate['next_start_in']:g}s" if rate["next_start_in"] else "")
                + (f" ({rate['keys']} keys)" if rate["keys"] > 1 else "")
            )
        conc_text = f"{conc['in_use']} / {conc['limit']}" if conc else "-"
        if conc and conc["keys"] > 1:
            conc_text += f" ({conc['keys']} keys, busiest {conc['busiest_key']})"
        override = ", ".join(f"{k} {v}" for k, v in sorted(t["overrides"].items())) or "-"
        rows.append(
            "<tr>"
            + _cells(e(t["task"]), rate_shown, use_text, conc_text, t["held"], e(override))
            + "</tr>"
        )
    return "<h2 id='limits'>Limits</h2>" + _table(
        ["task", "rate", "rate use", "slots in use", "requests held", "runtime override"],
        rows,
        "no task declares a global limit",
    )


def _schedule(schedule: Mapping[str, Any], *, actions: bool) -> str:
    e = html.escape
    leader = schedule.get("leader") or {}
    head = f"<p>leader: {e(str(leader.get('owner') or 'none'))}"
    if leader.get("fence"):
        head += f" (fence {leader['fence']}, leading for {leader.get('lease_age_s', 0):.0f}s)"
    head += "</p>"
    rows = []
    for entry in schedule.get("entries", []):
        name = entry["name"]
        led = bool(leader.get("owner"))
        # With no beat leading nothing fires: its next run would pass unseen as "active".
        state = "paused" if entry.get("paused") else "active" if led else "waiting: no beat leads"
        if entry.get("trigger_pending"):
            state += ", run triggered" if led else ", run triggered (when a beat leads)"
        controls = ""
        if actions:
            controls = _action_form(
                "resume" if entry.get("paused") else "pause",
                "name",
                name,
                "resume" if entry.get("paused") else "pause",
            ) + _action_form("trigger", "name", name, "trigger")
        rows.append(
            f"<tr data-entry='{e(name)}'>"
            + _cells(
                e(name),
                e(str(entry.get("task"))),
                e(str(entry.get("schedule"))),
                e(_when(entry.get("next_slot"))),
                e(_when(entry.get("last_slot"))),
                f"<code>{e(str(entry.get('last_id') or '-'))}</code>",
                f"{entry.get('fired', 0)} / {entry.get('missed', 0)}",
                state,
                controls,
            )
            + "</tr>"
        )
    return (
        "<h2 id='schedule'>Schedule</h2>"
        + head
        + _table(
            [
                "entry",
                "task",
                "schedule",
                "next run (UTC)",
                "last run",
                "last task id",
                "fired / missed",
                "state",
                "",
            ],
            rows,
            "no entries",
        )
    )


def _when(iso: str | None) -> str:
    return iso.replace("T", " ")[:19] if iso else "-"


def forbidden_page(why: str) -> str:
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>403 Forbidden</title></head>"
        f"<body><h1>403 Forbidden</h1><p id='why'>{html.escape(why)}</p>"
        "<p><a href='/'>back to the page</a></p></body></html>"
    )
