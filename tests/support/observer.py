"""The external observer: tasks report their runs here, checkers judge them.

The proof that "no two runs of one key overlap" must not trust the code under test, so
it lives outside the library, on its own connection (to the broker server's db 2, not
the store under test) and stamps every run with that server's ``TIME``: one clock for
all workers.

A task under test wraps its body::

    @app.task(bind=True, exclusive="key")
    def work(self, key):
        Observer(os.environ["TEST_OBSERVER_URL"]).run(key, fence(), sleep=0.2,
                                                       task_id=self.request.id)

and the test checks from outside::

    runs = observer.wait_for(20, timeout=30)
    assert_no_overlap(runs)
    assert_fences_increase(runs)

Keys written (all in the observer's db):

* ``observer:started`` -- list, one JSON entry per run *as it starts* (so a run killed
  mid-way is still visible): ``{start, key, fence, task_id, pid}``.
* ``observer:runs`` -- list, one JSON entry per *finished* run:
  ``{end, start, key, fence, task_id, pid}``.
* ``observer:running:<key>`` -- runs of ``key`` in progress now (a killed run stays
  counted: that is the point).
* ``observer:maxrun:<key>`` -- the highest ``observer:running:<key>`` ever seen.

Times are integers: microseconds since the epoch, by the observer server's clock.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import redis

STARTED = "observer:started"
RUNS = "observer:runs"

# KEYS[1] observer:running:<key>   KEYS[2] observer:maxrun:<key>   KEYS[3] observer:started
# ARGV[1] the entry as a JSON object without "start"
# Returns the start time, server TIME in microseconds, as a string.
_START = """
local t = redis.call('TIME')
local now = t[1] .. string.rep('0', 6 - #t[2]) .. t[2]
local running = redis.call('INCR', KEYS[1])
local most = tonumber(redis.call('GET', KEYS[2]) or '0')
if running > most then redis.call('SET', KEYS[2], running) end
redis.call('RPUSH', KEYS[3], '{"start":' .. now .. ',' .. string.sub(ARGV[1], 2))
return now
"""

# KEYS[1] observer:running:<key>   KEYS[2] observer:runs
# ARGV[1] the entry as a JSON object with "start" but without "end"
# Returns the end time, server TIME in microseconds, as a string.
_END = """
local t = redis.call('TIME')
local now = t[1] .. string.rep('0', 6 - #t[2]) .. t[2]
redis.call('DECR', KEYS[1])
redis.call('RPUSH', KEYS[2], '{"end":' .. now .. ',' .. string.sub(ARGV[1], 2))
return now
"""


@dataclass(frozen=True)
class Run:
    """One finished run: ``[start, end)`` in server microseconds."""

    key: str
    fence: int | None
    start: int
    end: int
    task_id: str = ""
    pid: int = 0


class Observer:
    """Records runs on its own connection. Cheap to create; one per process is plenty."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._redis = redis.Redis.from_url(url, decode_responses=True, socket_timeout=10)
        self._start = self._redis.register_script(_START)
        self._end = self._redis.register_script(_END)

    def close(self) -> None:
        """Close the connection pool."""
        self._redis.close()

    @contextlib.contextmanager
    def track(self, key: str, fence: int | None = None, *, task_id: str = "") -> Iterator[None]:
        """Record the ``with`` block as one run of ``key``.

        The start is recorded before the block runs and the end after it, also when it
        raises; a process killed inside the block leaves only its start behind.
        """
        entry: dict[str, Any] = {"key": key, "fence": fence, "task_id": task_id}
        entry["pid"] = os.getpid()
        running = f"observer:running:{key}"
        keys = [running, f"observer:maxrun:{key}", STARTED]
        start = int(self._start(keys=keys, args=[json.dumps(entry)]))
        try:
            yield
        finally:
            self._end(keys=[running, RUNS], args=[json.dumps({"start": start, **entry})])

    def run(
        self,
        key: str,
        fence: int | None = None,
        *,
        sleep: float = 0.0,
        task_id: str = "",
        until: str = "",
    ) -> None:
        """Record one run of ``key`` that lasts ``sleep`` seconds; with ``until``, until
        the test calls ``release(until)``, ``sleep`` seconds at most."""
        with self.track(key, fence, task_id=task_id):
            deadline = time.monotonic() + sleep
            while until and time.monotonic() < deadline:
                if self._redis.get(f"observer:release:{until}"):
                    return
                time.sleep(0.05)
            if sleep > 0 and not until:
                time.sleep(sleep)

    def release(self, name: str) -> None:
        """Let the runs that wait for ``name`` (``run(..., until=name)``) end now."""
        self._redis.set(f"observer:release:{name}", 1)

    def now_us(self) -> int:
        """The observer server's clock now (microseconds): the clock of every start."""
        seconds, micros = self._redis.time()
        return int(seconds) * 1_000_000 + int(micros)

    def runs(self) -> list[Run]:
        """Every finished run, in the order they finished."""
        return [Run(**json.loads(raw)) for raw in self._redis.lrange(RUNS, 0, -1)]

    def started(self) -> list[dict[str, Any]]:
        """Every start, finished or not: ``{start, key, fence, task_id, pid}`` dicts."""
        return [json.loads(raw) for raw in self._redis.lrange(STARTED, 0, -1)]

    def running(self, key: str) -> int:
        """How many runs of ``key`` have started and not finished (killed ones included)."""
        return int(self._redis.get(f"observer:running:{key}") or 0)

    def max_running(self, key: str) -> int:
        """The most runs of ``key`` that were ever in progress at once."""
        return int(self._redis.get(f"observer:maxrun:{key}") or 0)

    def starts_of(self, key: str, n: int = 1, timeout: float = 20) -> list[dict[str, Any]]:
        """The start entries of ``key`` (pid, fence, task_id, start) once there are ``n``."""
        deadline = time.monotonic() + timeout
        while True:
            starts = [s for s in self.started() if s["key"] == key]
            if len(starts) >= n:
                return starts
            if time.monotonic() > deadline:
                raise AssertionError(f"{len(starts)} of {n} runs of {key!r} started in {timeout} s")
            time.sleep(0.05)

    def runs_of(self, key: str, n: int = 1, timeout: float = 20) -> list[Run]:
        """The finished runs of ``key`` once there are ``n``."""
        deadline = time.monotonic() + timeout
        while True:
            runs = [r for r in self.runs() if r.key == key]
            if len(runs) >= n:
                return runs
            if time.monotonic() > deadline:
                raise AssertionError(f"{len(runs)} of {n} runs of {key!r} finished in {timeout} s")
            time.sleep(0.05)

    def wait_for(self, n: int, timeout: float) -> list[Run]:
        """Poll until at least ``n`` runs finished; return all of them.

        Raises ``AssertionError`` naming how many finished and started after ``timeout``.
        """
        deadline = time.monotonic() + timeout
        while True:
            runs = self.runs()
            if len(runs) >= n:
                return runs
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"waited {timeout} s for {n} finished runs: {len(runs)} finished, "
                    f"{len(self.started())} started"
                )
            time.sleep(0.05)


def _by_key(runs: Iterable[Run], per_key: bool) -> dict[str, list[Run]]:
    groups: dict[str, list[Run]] = defaultdict(list)
    for run in runs:
        groups[run.key if per_key else "*"].append(run)
    for group in groups.values():
        group.sort(key=lambda r: (r.start, r.end))
    return groups


def _describe(run: Run) -> str:
    return f"task {run.task_id or '?'} [{run.start}, {run.end}) fence={run.fence} pid={run.pid}"


def assert_no_overlap(runs: Iterable[Run], *, per_key: bool = True) -> None:
    """Assert that no two runs of one key overlap (of any key, with ``per_key=False``).

    Runs are half-open intervals ``[start, end)``: one may start in the microsecond the
    previous one ended. The message names the key and both runs of each overlap.
    """
    overlaps: list[str] = []
    for key, group in sorted(_by_key(runs, per_key).items()):
        latest: Run | None = None  # the run that ends last among those seen so far
        for run in group:
            if latest is not None and run.start < latest.end:
                overlaps.append(f"key {key!r}: {_describe(latest)} overlaps {_describe(run)}")
            if latest is None or run.end > latest.end:
                latest = run
    if overlaps:
        shown = "\n  ".join(overlaps[:10])
        raise AssertionError(f"{len(overlaps)} overlapping run(s):\n  {shown}")


def assert_fences_increase(runs: Iterable[Run]) -> None:
    """Assert that per key, in start order, fences strictly increase (``None`` ignored)."""
    problems: list[str] = []
    for key, group in sorted(_by_key(runs, per_key=True).items()):
        fenced = [r for r in group if r.fence is not None]
        for before, after in itertools.pairwise(fenced):
            assert before.fence is not None and after.fence is not None
            if after.fence <= before.fence:
                problems.append(
                    f"key {key!r}: {_describe(after)} started after {_describe(before)}"
                )
    if problems:
        shown = "\n  ".join(problems[:10])
        raise AssertionError(f"{len(problems)} fence(s) not increasing:\n  {shown}")


def max_concurrent(runs: Iterable[Run], key: str | None = None) -> int:
    """The most runs (of ``key``, or of any key) in progress at one instant.

    A sweep over half-open ``[start, end)`` intervals: a run ending at ``t`` and one
    starting at ``t`` are not concurrent.
    """
    events: list[tuple[int, int]] = []
    for run in runs:
        if key is None or run.key == key:
            events += [(run.start, 1), (run.end, -1)]
    events.sort()  # at equal times -1 sorts before +1: ends first
    most = now = 0
    for _, delta in events:
        now += delta
        most = max(most, now)
    return most
