"""``/metrics`` of the web view: the store-wide view in Prometheus' text format, one
scrape target for every worker (built from what the workers report to the store)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

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
