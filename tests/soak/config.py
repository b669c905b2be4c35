"""One soak run's settings: its lengths, its machines, its workload and its fault mix."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

#: What the publisher sends (each a task of tests.apps.soak); ``--only`` picks some.
PUBLISH_KINDS = (
    "ex_skip", "ex_wait", "capped", "uq", "guarded", "rated", "inorder", "batched", "cancelled",
    "busy",
)  # fmt: skip


@dataclass
class SoakConfig:
    """One soak run. Durations in seconds."""

    seed: int
    fault_seconds: float = 120.0
    #: How long the backlog may take to drain once the faults stop.
    drain_seconds: float = 60.0
    machines: int = 2
    concurrency: int = 3
    #: Seconds between two faults (uniform).
    gap: tuple[float, float] = (2.0, 5.0)
    #: Seconds between two publishes (uniform).
    publish_gap: tuple[float, float] = (0.2, 0.45)
    #: Plain ``busy`` tasks: how long each sleeps (uniform, seconds), and their surges:
    #: for ``busy_surge`` seconds one every ``busy_surge_gap`` (with the other kinds, more
    #: work than both pools can take: every process busy, guarded requests wait), then
    #: for ``busy_calm`` seconds one every ``busy_calm_gap`` (the backlog drains). Surges
    #: rather than a steady stream at the pools' capacity, whose backlog would only grow
    #: while faults take workers away.
    busy_sleep: tuple[float, float] = (0.2, 2.0)
    busy_surge: tuple[float, float] = (3.0, 8.0)
    busy_surge_gap: tuple[float, float] = (0.1, 0.35)
    busy_calm: tuple[float, float] = (5.0, 12.0)
    busy_calm_gap: tuple[float, float] = (1.5, 3.0)
    lease_ttl: float = 6.0
    log_dir: Path | None = None
    #: Also export the store's URL as ``$BATON_URL``: a part that ignores
    #: ``Baton(app, url=...)`` then still finds the store (to look past issue 11, item 1).
    url_in_env: bool = False
    #: Publish only these kinds of task (default: every kind): a focused soak.
    only: tuple[str, ...] = ()
    #: How the workers run tasks (tests.soak.machines.WORKER_PROFILES), taken in turn by
    #: each machine's worker starts: pools and settings under the same faults.
    profiles: tuple[str, ...] = ("prefork",)
    #: Fault kind -> weight. Every kind listed in :meth:`Nemesis.faults`.
    weights: dict[str, float] = field(
        default_factory=lambda: {
            "kill_child": 3,
            "kill_worker": 1.5,
            "pause_store": 2,
            "restart_store": 1,
            "pause_broker": 1.5,
            "restart_broker": 1,
            "kill_beat": 1.5,
            "edit": 1.5,
            "republish": 2,
        }
    )
