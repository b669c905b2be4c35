"""A stream of batched calls through a store failover, and how its end is judged: the
Sentinel (tests/failover/test_sentinel_batching.py) and Redis Cluster
(tests/failover/test_cluster_batching.py) failover tests publish ``steady`` calls with
:class:`Publisher` while the store's master changes, then both end with
:func:`judge_stream`: every call in exactly one successful run (after a run ttl in which
a lapsed or forgotten run's calls would have run again), each caller its own result, the
calls published after the change run too, and at least one key saw the promotion.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from tests.batching.test_batching import assert_each_call_once, call_ids, runs_of, settle
from tests.support.observer import Observer, Run

KEYS = 4
#: What a worker logs when it marks the batches it ran done again (a promoted store may
#: lack their done markers): "<n> calls of batches this worker ran".
MARKED_AGAIN = re.compile(r"(\d+) calls of batches this worker ran")


class Publisher:
    """Publishes ``steady`` calls of KEYS keys (or of ``accounts``), one every ``every``
    seconds, from a thread until stopped: ``{task id: (its AsyncResult, its doc)}`` and
    the ids published after :meth:`mark`."""

    def __init__(self, every: float = 0.1, accounts: list[str] | None = None) -> None:
        self.every = every
        self.accounts = accounts or [f"s{n}" for n in range(KEYS)]
        self.results: dict[str, tuple[Any, int]] = {}
        self.after: list[str] = []
        self._marked = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from tests.apps.batching import steady

        doc = 0
        while not self._stop.is_set():
            account = self.accounts[doc % len(self.accounts)]
            result = steady.apply_async(kwargs={"account": account, "doc": doc})
            self.results[result.id] = (result, doc)
            if self._marked:
                self.after.append(result.id)
            doc += 1
            time.sleep(self.every)

    def mark(self) -> None:
        self._marked = True

    def __enter__(self) -> Publisher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def judge_stream(
    observer: Observer,
    stream: Publisher,
    pool: Sequence[Any],
    *,
    label: str,
    lease_ttl: float,
    changed_us: int,
    promoted_us: int,
    more: Callable[[list[Run]], str] = lambda runs: "",
) -> list[Run]:
    """The end of a failover test: settle, re-read after a run ttl, print what was seen
    (``label`` first, ``more(runs)`` last; each call that ran twice with its runs' times
    from the change), and assert each call ran once with its own result. The runs."""
    results = stream.results
    settle(observer, "steady", len(results), timeout=60)
    time.sleep(lease_ttl + 1)  # a lapsed or forgotten run's calls would run again by now
    runs = runs_of(observer, "steady")
    logs = "".join(w.log_text() for w in pool)
    redone = sum(int(n) for n in MARKED_AGAIN.findall(logs))
    promotions = logs.count("promoted from a replica")
    extra = more(runs)
    print(
        f"\n{label}; {len(results)} calls ({len(stream.after)} after), {len(runs)} runs, "
        f"largest {max(len(call_ids(r)) for r in runs)}; keys that saw the promotion: "
        f"{promotions}; calls marked done again: {redone}{'; ' + extra if extra else ''}"
    )
    seen: dict[str, list[Run]] = {}
    for r in runs:
        for i in call_ids(r):
            seen.setdefault(i, []).append(r)
    for i, twice in seen.items():
        if len(twice) > 1:
            print(f"call {i} ran in:")
            for r in twice:
                print(
                    f"  {r.key} pid {r.pid} start {(r.start - changed_us) / 1e6:+.3f} s "
                    f"end {(r.end - changed_us) / 1e6:+.3f} s (promoted at "
                    f"{(promoted_us - changed_us) / 1e6:+.3f}) calls {r.task_id}"
                )
    assert all("|" not in r.key for r in runs), "a run held calls of two keys"
    assert_each_call_once(runs, list(results))
    assert set(stream.after) <= set(seen), "a call published after the change never ran"
    # Each key's first tick on the promoted server saw the promotion (its grace: no claim
    # while runners write back what the old master took last). At least one key logged
    # it. In a loaded CI run 2 of the 4 keys did, each call still ran once: a tick that
    # ran on the new master but whose reply was lost (a socket timeout, frequent in a
    # failover under load) sets the grace without the line, and the key's next tick
    # finds the epoch rewritten. Not yet shown to be the cause.
    assert promotions >= 1, "no key saw the promotion"
    for result, doc in results.values():
        assert result.get(timeout=30) == doc * 3, "each caller gets its own call's result"
    return runs
