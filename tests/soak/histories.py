"""Hand-made histories for the checker's tests: times in seconds here, microseconds in the
history."""

from __future__ import annotations

from typing import Any

from tests.soak.checker import History, Published, Report, Run, check

S = 1_000_000


def run(key: str, task_id: str, start: float, end: float | None, fence: int | None = None,
        pid: int = 1) -> Run:  # fmt: skip
    return Run(key, task_id, int(start * S), None if end is None else int(end * S), fence, pid)


def sent(task_id: str, at: float = 0.0, task: str = "t") -> Published:
    return Published(task_id, task, int(at * S))


def judge(runs: list[Run], **kw: Any) -> Report:
    """Check a history in which every run's task id was published (and so accounted)."""
    published = kw.pop("published", None)
    if published is None:
        published = [sent(t) for t in dict.fromkeys(r.task_id for r in runs)]
    return check(History(runs=runs, published=published, **kw), seed=42)


def into(holder: str, at: float, task_id: str = "d") -> Published:
    return Published(task_id, "uq", int(at * S), "deduplicated", into=holder)
