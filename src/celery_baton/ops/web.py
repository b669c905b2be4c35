"""``celery -A proj baton web``: the store-wide view for operators, in a browser.

One page (server-rendered, standard library only): workers and their last report, live
leases (stale ones marked), unique claims, every limit with its current use, and the
beat schedule. The actions of the CLI (unlock, pause, resume, trigger) are POSTs that
need the token given to the server (``--token`` or ``$BATON_WEB_TOKEN``): without it
the page is read-only, and a missing or wrong token is answered 403. ``/api/state`` is
the same data as JSON; ``/metrics`` is the store-wide view in Prometheus' text format,
one scrape target for every worker (built from what the workers report to the store).

Celery-free: the server reads through a :class:`Source` (the CLI's ``Context``) and a
:class:`Schedules` (``ScheduleStore``)::

    serve(Context(app), ScheduleStore(app), host="127.0.0.1", port=8765, token="s3cret")
"""

from __future__ import annotations

import hmac
import html
import json
import logging
import re
import time
from collections.abc import Callable, Mapping
from http import HTTPStatus
from http.cookies import SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import parse_qs, urlencode, urlsplit

from celery_baton.core.rates import parse_rate
from celery_baton.errors import BatonError
from celery_baton.store import inspect as store_inspect

if TYPE_CHECKING:
    from celery_baton.core.keys import KeyNames
    from celery_baton.core.policy.model import TaskPolicy
    from celery_baton.store import Store

logger = logging.getLogger("celery_baton.ops.web")

COOKIE = "baton_token"
ACTIONS = ("unlock", "pause", "resume", "trigger")
TOKEN_CHARS = re.compile(r"[A-Za-z0-9._~+/=-]+")  # what `secrets.token_urlsafe()` makes


class Source(Protocol):
    """What the page reads (the CLI's ``Context`` is one)."""

    @property
    def store(self) -> Store: ...

    @property
    def names(self) -> KeyNames: ...

    def holders(self) -> list[store_inspect.LeaseRow]: ...

    def live_workers(self) -> set[str]: ...

    def policies(self) -> Mapping[str, tuple[Any, TaskPolicy]]: ...


class Schedules(Protocol):
    """The schedule's listing and operations (``ScheduleStore`` is one)."""

    def describe(self) -> dict[str, Any]: ...

    def pause(self, name: str) -> None: ...

    def resume(self, name: str) -> None: ...

    def trigger(self, name: str) -> None: ...


# -- the state -------------------------------------------------------------------------


def collect(source: Source, schedules: Schedules) -> dict[str, Any]:
    """Everything the page shows, as JSON values (``/api/state``)."""
    store, prefix = source.store, source.names.prefix
    reports = store_inspect.workers(store, prefix)
    ttls = store_inspect.worker_report_ttls(store, prefix)
    holders = source.holders()
    leases = [r for r in holders if r.kind != "unique"]
    claims = [r for r in holders if r.kind == "unique"]
    per_worker: dict[str, int] = {}
    for row in leases:
        per_worker[row.worker] = per_worker.get(row.worker, 0) + 1
    workers = []
    for report in reports:
        name = report.get("hostname", "")
        workers.append(
            {**report, "leases_in_store": per_worker.get(name, 0), "expires_in": ttls.get(name)}
        )
    return {
        "store": store.safe_url,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "workers": workers,
        "leases": [r.as_dict() for r in leases],
        "unique_claims": [r.as_dict() for r in claims],
        "limits": _limits(source, leases, reports),
        "schedule": schedules.describe(),
    }


def _limits(
    source: Source, leases: list[store_inspect.LeaseRow], reports: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Each declared global limit with its use now: the part of the rate's burst in use
    (and how long until the next start may pass), concurrency slots in use, and the
    requests workers hold for the task."""
    held: dict[str, int] = {}
    for report in reports:
        for key, count in (report.get("held_by_key") or {}).items():
            task = key[key.find("{") + 1 : key.find("}")]
            held[task] = held.get(task, 0) + int(count)
    rows = []
    for name, (task, policy) in source.policies().items():
        overrides = store_inspect.limit_overrides(source.store, source.names.limits(name))
        row: dict[str, Any] = {
            "task": name,
            "overrides": overrides,
            "held": held.get(name, 0),
            "rate": None,
            "concurrency": None,
        }
        per_second, burst = _rate(task, policy, overrides.get("rate"))
        if per_second:
            interval = 1_000_000 / per_second
            ahead = store_inspect.rate_ahead_us(source.store, source.names.prefix, name)
            busiest = max(ahead, default=0)
            row["rate"] = {
                "per_second": per_second,
                "burst": burst,
                "keys": len(ahead),
                "burst_in_use": round(min(busiest / interval, burst), 2),
                "next_start_in": round(max(0.0, busiest - (burst - 1) * interval) / 1e6, 3),
            }
        limit = _concurrency(policy, overrides.get("concurrency"))
        if limit:
            mine = [r for r in leases if r.task == name and r.kind == "concurrency"]
            per_key: dict[str, int] = {}
            for r in mine:
                per_key[r.key] = per_key.get(r.key, 0) + 1
            row["concurrency"] = {
                "limit": limit,
                "in_use": len(mine),
                "keys": len(per_key),
                "busiest_key": max(per_key.values(), default=0),
            }
        if row["rate"] or row["concurrency"]:
            rows.append(row)
    return rows


def _rate(task: Any, policy: TaskPolicy, override: str | None) -> tuple[float, int]:
    """(runs per second, burst) in force: the runtime override, else the declaration."""
    if override:
        interval, _, burst = override.partition(" ")
        return 1_000_000 / int(interval), int(burst or 1)
    if policy.rate:
        return policy.rate.per_second, policy.rate.burst
    if policy.rate_from_celery and getattr(task, "rate_limit", None):
        try:
            return parse_rate(task.rate_limit), 1
        except BatonError:
            return 0.0, 1
    return 0.0, 1


def _concurrency(policy: TaskPolicy, override: str | None) -> int:
    if override:
        return int(override)
    return policy.concurrency.limit if policy.concurrency else 0


# -- actions ---------------------------------------------------------------------------


class Refused(Exception):
    """An action that did not happen, with the reason an operator reads."""


def act(source: Source, schedules: Schedules, form: Mapping[str, str]) -> str:
    """Run one action of the CLI; returns what happened, raises :class:`Refused`."""
    action = form.get("action", "")
    try:
        if action == "unlock":
            key = form.get("key", "")
            force = form.get("force") in ("1", "on", "true")
            if not store_inspect.exists(source.store, key):
                raise Refused(f"{key}: no such lease or unique claim")
            removed, live = store_inspect.unlock(
                source.store, key, force=force, channel=source.names.notice_channel
            )
            if live and not force:
                words = store_inspect.label(source.store, key)
                named = f"{key} ({words})" if words else key
                held = holders_in_words(live, source.live_workers())
                raise Refused(f"{named} {held}: tick force to free it")
            return f"{key}: {removed} holder(s) removed"
        if action in ("pause", "resume", "trigger"):
            name = form.get("name", "")
            getattr(schedules, action)(name)
            return f"{name}: {action}d" if action != "trigger" else f"{name}: triggered"
    except BatonError as exc:
        raise Refused(str(exc)) from exc
    raise Refused(f"unknown action {action!r} (one of {', '.join(ACTIONS)})")


def holders_in_words(owners: list[str], live_workers: set[str]) -> str:
    """Who holds a key, in words (never the owner token ``task|worker|nonce``): a
    unique claim's task, a live run, or a stale lease."""
    parts = []
    for owner in owners:
        task_id, _, rest = owner.partition("|")
        worker = rest.split("|", 1)[0]
        if not worker:
            parts.append(f"is claimed by task {task_id} (queued or running)")
        elif worker in live_workers:
            parts.append(
                f"is held by a live run (task {task_id} on {worker}); it is renewed while "
                "that run lives"
            )
        else:
            parts.append(
                f"is held by task {task_id} on {worker}, which stopped reporting: the lease "
                "is STALE and ends when its TTL runs out"
            )
    return "; ".join(parts)


# -- Prometheus ------------------------------------------------------------------------

# Counters of the worker reports: report field -> (metric, help).
_REPORT_COUNTERS = {
    "admitted": ("baton_worker_admitted_total", "Requests the gate admitted, per worker"),
    "skipped": ("baton_worker_skipped_total", "Requests acked without running, per worker"),
    "throttled": ("baton_worker_throttled_total", "Gate denials by a rate limit, per worker"),
    "handed_back": ("baton_worker_handed_back_total", "Held requests returned to the broker"),
    "holds_total": ("baton_worker_holds_total", "Requests held in the consumer, per worker"),
    "renewals": ("baton_worker_lease_renewals_total", "Leases renewed, per worker"),
    "losses": ("baton_worker_lease_losses_total", "Leases found taken over at renewal"),
}


def metrics_text(state: Mapping[str, Any] | None) -> str:
    """The store-wide view in Prometheus' text format (version 0.0.4); ``None``: the
    store did not answer, which is a value (``baton_store_up 0``), not a failed scrape."""
    out: list[str] = []

    def family(name: str, kind: str, doc: str, samples: list[tuple[dict[str, Any], Any]]) -> None:
        out.append(f"# HELP {name} {doc}")
        out.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            text = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
            out.append(f"{name}{{{text}}} {float(value):g}" if text else f"{name} {value:g}")

    family(
        "baton_store_up",
        "gauge",
        "1 when the store answered this scrape, 0 when it did not",
        [({}, 0 if state is None else 1)],
    )
    if state is None:
        return "\n".join(out) + "\n"
    workers = state["workers"]
    family(
        "baton_worker_up",
        "gauge",
        "1 per worker that reported to the store within its report ttl",
        [({"worker": w["hostname"]}, 1) for w in workers],
    )
    family(
        "baton_worker_held_requests",
        "gauge",
        "Requests held in the worker's consumer now",
        [({"worker": w["hostname"]}, w.get("held", 0)) for w in workers],
    )
    family(
        "baton_worker_leases",
        "gauge",
        "Leases the worker holds now (its own count)",
        [({"worker": w["hostname"]}, w.get("leases", 0)) for w in workers],
    )
    for field, (name, doc) in _REPORT_COUNTERS.items():
        family(
            name, "counter", doc, [({"worker": w["hostname"]}, w.get(field, 0)) for w in workers]
        )

    by_worker: dict[tuple[str, str], int] = {}
    stale = 0
    for lease in state["leases"]:
        label = (lease["worker"], lease["kind"])
        by_worker[label] = by_worker.get(label, 0) + 1
        stale += bool(lease["stale"])
    family(
        "baton_store_leases",
        "gauge",
        "Live leases in the store, by holding worker and kind",
        [({"worker": w, "kind": k}, n) for (w, k), n in sorted(by_worker.items())],
    )
    family(
        "baton_store_stale_leases",
        "gauge",
        "Live leases whose worker stopped reporting (they end when their ttl runs out)",
        [({}, stale)],
    )
    family(
        "baton_store_unique_claims",
        "gauge",
        "Unique claims in the store (queued or running task ids)",
        [({}, len(state["unique_claims"]))],
    )
    limits = state["limits"]
    family(
        "baton_store_concurrency_in_use",
        "gauge",
        "Concurrency slots in use, per task",
        [({"task": t["task"]}, t["concurrency"]["in_use"]) for t in limits if t["concurrency"]],
    )
    family(
        "baton_store_concurrency_limit",
        "gauge",
        "Global concurrency limit in force, per task",
        [({"task": t["task"]}, t["concurrency"]["limit"]) for t in limits if t["concurrency"]],
    )
    family(
        "baton_store_rate_burst_in_use",
        "gauge",
        "Part of the rate's burst in use on the busiest key, per task",
        [({"task": t["task"]}, t["rate"]["burst_in_use"]) for t in limits if t["rate"]],
    )
    entries = state["schedule"].get("entries", [])
    for field in ("fired", "missed", "suppressed"):
        family(
            f"baton_beat_entry_{field}_total",
            "counter",
            f"Beat slots {field}, per entry (kept in the store, across leaders)",
            [({"entry": e["name"]}, e.get(field, 0)) for e in entries],
        )
    family(
        "baton_beat_entry_paused",
        "gauge",
        "1 while the entry is paused",
        [({"entry": e["name"]}, int(bool(e.get("paused")))) for e in entries],
    )
    return "\n".join(out) + "\n"


def _label(value: Any) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


# -- the page --------------------------------------------------------------------------

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
    parts.append(_limits_table(state["limits"]))
    parts.append(_schedule(state["schedule"], actions=controls))
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


def _limits_table(limits: list[dict[str, Any]]) -> str:
    e = html.escape
    rows = []
    for t in limits:
        rate, conc = t["rate"], t["concurrency"]
        rate_text = use_text = "-"
        if rate:
            rate_text = f"{rate['per_second']:g}/s burst {rate['burst']}"
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
            + _cells(e(t["task"]), rate_text, use_text, conc_text, t["held"], e(override))
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
        state = "paused" if entry.get("paused") else "active"
        if entry.get("trigger_pending"):
            state += ", run triggered"
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


# -- the server ------------------------------------------------------------------------


class WebServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        source: Source,
        schedules: Schedules,
        *,
        token: str | None,
        refresh: float = 5.0,
    ) -> None:
        super().__init__(address, _Handler)
        self.source, self.schedules = source, schedules
        self.token, self.refresh = token or None, refresh
        # What the store held when it last answered, and since when it does not.
        self.last_state: dict[str, Any] | None = None
        self.down_since: float | None = None

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}/"

    def state(self) -> dict[str, Any]:
        try:
            state = collect(self.source, self.schedules)
        except BatonError:
            if self.down_since is None:
                self.down_since = time.time()
                logger.warning("web: the store does not answer; the page says so")
            raise
        if self.down_since is not None:
            logger.warning("web: the store answers again")
        self.last_state, self.down_since = state, None
        return state

    def outage(self, exc: BatonError) -> tuple[dict[str, Any], str]:
        """The state to show while the store is down (the last one read, or an empty
        one), and what the banner says."""
        since = time.strftime("%H:%M:%SZ", time.gmtime(self.down_since or time.time()))
        state = self.last_state
        shown = f"what it held at {state['time']}" if state else "nothing (none read yet)"
        if state is None:
            state = {
                "store": self.source.store.safe_url,
                "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "workers": [],
                "leases": [],
                "unique_claims": [],
                "limits": [],
                "schedule": {},
            }
        text = (
            f"store unavailable since {since}: {exc}. Showing {shown}; this page "
            f"refreshes every {self.refresh:g}s and shows the store again once it answers."
        )
        return state, text


class _Handler(BaseHTTPRequestHandler):
    server: WebServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        logger.info("%s %s", self.address_string(), format % args)

    # -- routing

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        routes: dict[str, Callable[[], None]] = {
            "/": lambda: self._page(parse_qs(url.query)),
            "/api/state": lambda: self._json(HTTPStatus.OK, self._state()),
            "/metrics": self._metrics,
        }
        route = routes.get(url.path)
        if route is None:
            self._send(HTTPStatus.NOT_FOUND, "text/plain", "not found\n")
            return
        try:
            route()
        except BatonError as exc:  # the store went away: say so, keep serving
            if url.path == "/":
                self._page(parse_qs(url.query), down=exc)
            elif url.path == "/metrics":
                self._send(HTTPStatus.OK, "text/plain; version=0.0.4", metrics_text(None))
            else:
                self._json(HTTPStatus.SERVICE_UNAVAILABLE, {"error": str(exc)})

    def do_POST(self) -> None:
        path = urlsplit(self.path).path
        form = self._form()
        if path == "/login":
            if not self._valid(form.get("token")):
                self._forbidden(form.get("token"), path)
                return
            self._redirect("/", cookie=f"{COOKIE}={form['token']}")
            return
        if path == "/logout":
            self._redirect("/", cookie=f"{COOKIE}=; Max-Age=0")
            return
        if path not in ("/action", "/api/action"):
            self._send(HTTPStatus.NOT_FOUND, "text/plain", "not found\n")
            return
        if not self._valid(self._token(form)):
            self._forbidden(self._token(form), path)
            return
        try:
            done = act(self.server.source, self.server.schedules, form)
        except Refused as exc:
            logger.warning("web: %s refused: %s", form.get("action"), exc)
            if path == "/api/action":
                self._json(HTTPStatus.CONFLICT, {"ok": False, "error": str(exc)})
            else:
                self._redirect("/?" + urlencode({"error": str(exc)}))
            return
        logger.warning("web: %s by %s", done, self.address_string())
        if path == "/api/action":
            self._json(HTTPStatus.OK, {"ok": True, "done": done})
        else:
            self._redirect("/?" + urlencode({"note": done}))

    # -- pages

    def _state(self) -> dict[str, Any]:
        return self.server.state()

    def _page(self, query: Mapping[str, list[str]], down: BatonError | None = None) -> None:
        state, outage = self.server.outage(down) if down else (self._state(), "")
        body = render_page(
            state,
            actions=self.server.token is not None,
            signed_in=self._valid(self._cookie()),
            refresh=self.server.refresh,
            note=query.get("note", [""])[0],
            error=query.get("error", [""])[0],
            outage=outage,
        )
        # A page still (it refreshes itself), with the status a probe understands.
        status = HTTPStatus.SERVICE_UNAVAILABLE if down else HTTPStatus.OK
        self._send(status, "text/html; charset=utf-8", body)

    def _metrics(self) -> None:
        self._send(HTTPStatus.OK, "text/plain; version=0.0.4", metrics_text(self._state()))

    # -- the token

    def _valid(self, given: str | None) -> bool:
        expected = self.server.token
        if expected is None or not given:
            return False
        return hmac.compare_digest(given.encode(), expected.encode())

    def _token(self, form: Mapping[str, str]) -> str | None:
        auth = self.headers.get("Authorization", "")
        if auth.startswith("Bearer "):
            return auth[len("Bearer ") :]
        return form.get("token") or self._cookie()

    def _cookie(self) -> str | None:
        cookie = SimpleCookie(self.headers.get("Cookie", ""))
        morsel = cookie.get(COOKIE)
        return morsel.value if morsel is not None and morsel.value else None

    def _forbidden(self, given: str | None, path: str) -> None:
        if self.server.token is None:
            why = "actions are disabled: the server was started without a token"
        elif given:
            # Someone tried a token: the operator must be able to see it (and how often).
            logger.warning("web: wrong token from %s on %s", self.address_string(), path)
            why = "wrong token: it is not the one this server was started with"
        else:
            why = "this needs the server's token: sign in on the page first"
        if path.startswith("/api/"):
            self._json(HTTPStatus.FORBIDDEN, {"ok": False, "error": why})
            return
        self._send(HTTPStatus.FORBIDDEN, "text/html; charset=utf-8", _forbidden_page(why))

    # -- plumbing

    def _form(self) -> dict[str, str]:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(min(length, 64 * 1024)).decode("utf-8", "replace")
        if self.headers.get("Content-Type", "").startswith("application/json"):
            try:
                data = json.loads(raw or "{}")
            except ValueError:
                return {}
            return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}
        return {k: v[0] for k, v in parse_qs(raw).items()}

    def _redirect(self, location: str, cookie: str | None = None) -> None:
        self.send_response(HTTPStatus.SEE_OTHER)
        self.send_header("Location", location)
        if cookie is not None:
            # SameSite=Strict: another site's page cannot make this browser post an action.
            self.send_header("Set-Cookie", f"{cookie}; Path=/; HttpOnly; SameSite=Strict")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _json(self, status: HTTPStatus, data: Any) -> None:
        self._send(status, "application/json", json.dumps(data, default=str))

    def _send(self, status: HTTPStatus, content_type: str, body: str) -> None:
        raw = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(raw)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(raw)


def _forbidden_page(why: str) -> str:
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>403 Forbidden</title></head>"
        f"<body><h1>403 Forbidden</h1><p id='why'>{html.escape(why)}</p>"
        "<p><a href='/'>back to the page</a></p></body></html>"
    )


def serve(
    source: Source,
    schedules: Schedules,
    *,
    host: str = "127.0.0.1",
    port: int = 8765,
    token: str | None = None,
    refresh: float = 5.0,
    ready: Callable[[WebServer], None] | None = None,
) -> None:
    """Serve the page until interrupted (``ready`` is called once it listens)."""
    if token is not None and not TOKEN_CHARS.fullmatch(token):
        # It travels in a cookie, which cannot carry spaces, quotes or semicolons.
        raise ValueError("the token may use letters, digits and . _ ~ + / = - only")
    server = WebServer((host, port), source, schedules, token=token, refresh=refresh)
    try:
        if ready is not None:
            ready(server)
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
