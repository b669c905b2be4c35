"""The soak's history read back once it is over: the observer's runs and skips, the
results and the workers' logs as a :class:`tests.soak.checker.History`, and the store's
keys for a post-mortem."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import redis

from tests.soak.checker import (
    CANCEL_TASKS,
    Cancel,
    Fault,
    History,
    Limits,
    Published,
    Skip,
    broker_moments,
    lost_lease_task_ids,
    merge_runs,
    ordered_log_notes,
    received_moments,
    received_task_ids,
    unchecked_cancel_ids,
)
from tests.soak.config import SoakConfig
from tests.soak.machines import Machine
from tests.support.observer import RUNS, STARTED
from tests.support.servers import StoreServer

SKIPPED = "soak:skipped"  # tests.apps.soak.SKIPPED, without importing the app here
#: The kinds whose results' values the checker reads (each caller's own result).
VALUED = ("inorder", "batched")


class Recorder:
    """The reading back, a part of :class:`tests.soak.nemesis.Nemesis`."""

    # The Nemesis's state that the reading back reads.
    config: SoakConfig
    root: Path
    store: StoreServer
    machines: list[Machine]
    published: list[Published]
    cancels: list[Cancel]
    faults: list[Fault]
    module: Any
    observer_db: redis.Redis
    results_db: redis.Redis

    def _dump_store(self) -> None:
        """The store's keys after the drain, in ``store.txt``: who still holds what (a
        lease's owner names its task id and worker) for a post-mortem."""
        lines = []
        try:
            with self.store.client() as r:
                for key in sorted(r.scan_iter(count=1000))[:5000]:
                    kind = r.type(key)
                    if kind == "hash":
                        value: Any = r.hgetall(key)
                    elif kind == "string":
                        value = r.get(key)
                    elif kind == "zset":
                        value = r.zrange(key, 0, 50, withscores=True)
                    elif kind == "list":
                        value = r.lrange(key, 0, 50)
                    elif kind == "set":
                        value = sorted(r.sscan_iter(key, count=100))[:50]
                    else:
                        value = "?"
                    lines.append(f"{key} {kind} ttl={r.pttl(key)} {value}")
        except redis.RedisError as exc:
            lines.append(f"store unreadable: {exc!r}")
        (self.root / "store.txt").write_text("\n".join(lines) + "\n")

    def _history(self) -> History:
        started = [json.loads(x) for x in self.observer_db.lrange(STARTED, 0, -1)]
        finished = [json.loads(x) for x in self.observer_db.lrange(RUNS, 0, -1)]
        skips = [
            Skip(
                task_id=e["task_id"],
                reason=e["reason"],
                at=int(e["at"]),
                holder=e.get("holder", ""),
                key=e.get("key", ""),
                task=e.get("task", ""),
            )
            for e in map(json.loads, self.observer_db.lrange(SKIPPED, 0, -1))
        ]
        ids = sorted({p.task_id for p in self.published} | {s.task_id for s in skips})
        results: dict[str, str] = {}
        values: dict[str, Any] = {}
        judged = {p.task_id for p in self.published if p.task in VALUED}
        pipe = self.results_db.pipeline(transaction=False)
        for task_id in ids:
            pipe.get(f"celery-task-meta-{task_id}")
        for task_id, raw in zip(ids, pipe.execute(), strict=True):
            if raw:
                meta = json.loads(raw)
                results[task_id] = _state(meta)
                if task_id in judged:
                    values[task_id] = meta.get("result")
        lost: set[str] = set()
        received: set[str] = set()
        moments: dict[str, tuple[int, bool]] = {}
        order_skips: list[tuple[str, str, int]] = []
        order_lost: set[str] = set()
        cancel_calls = {p.task_id for p in self.published if p.task in CANCEL_TASKS}
        received_at: dict[str, list[int]] = {}
        unchecked: set[str] = set()
        for machine in self.machines:
            logs = machine.logs()
            gaps, placed_lost = ordered_log_notes(logs)
            order_skips += gaps
            order_lost |= placed_lost
            lost |= lost_lease_task_ids(logs)
            received |= received_task_ids(logs)
            unchecked |= unchecked_cancel_ids(logs)
            for task_id, moments_of in received_moments(logs).items():
                if task_id in cancel_calls:
                    received_at[task_id] = sorted(received_at.get(task_id, []) + moments_of)
            for task_id, moment in broker_moments(logs).items():
                moments[task_id] = max(moments.get(task_id, moment), moment)
        return History(
            runs=merge_runs(started, finished),
            published=list(self.published),
            skips=skips,
            faults=list(self.faults),
            results=results,
            lost_leases=lost,
            received=received,
            to_broker={task_id: at for task_id, (at, handed) in moments.items() if handed},
            values=values,
            order_skips=order_skips,
            order_lost=order_lost,
            cancels=list(self.cancels),
            received_at=received_at,
            cancel_unchecked=unchecked,
            limits=Limits(
                lease_ttl=self.config.lease_ttl,
                cap=self.module.CAP,
                rate=self.module.RATE,
                burst=self.module.BURST,
                # visibility_timeout, then a restore each second under a 5 s mutex.
                redelivery=self.module.VISIBILITY + 10.0,
                pool_size=self.config.machines * self.config.concurrency,
                ordered_gap=self.module.ORDERED_GAP,
            ),
        )


def _state(meta: dict[str, Any]) -> str:
    status = str(meta.get("status", ""))
    result = meta.get("result")
    if status == "FAILURE" and isinstance(result, dict) and result.get("exc_type"):
        return f"{status}:{result['exc_type']}"
    return status


def _dump(history: History) -> str:
    from dataclasses import asdict

    data = asdict(history)
    data["lost_leases"] = sorted(history.lost_leases)
    data["received"] = sorted(history.received or ())
    data["order_lost"] = sorted(history.order_lost)
    data["cancel_unchecked"] = sorted(history.cancel_unchecked)
    return json.dumps(data, indent=1, default=str)
