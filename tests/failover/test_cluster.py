"""celery-baton on a real Redis Cluster (3 masters, 1 replica each), with real workers.

``BATON_URL`` is ``redis+cluster://...``; broker and observer stay on the broker server.
Beside the tests shared with Sentinel (``test_both.py``): leases renewed past their
ttl, unique, a global concurrency cap, the redelivery guard, and a master SIGKILLed
mid-run while its replica is promoted.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from types import ModuleType

import pytest

from tests.beat.helpers import (
    BEAT_KEYS,
    beat_env,
    start_two_beats,
    wait_for_leader,
    wait_for_slots,
)
from tests.beat.test_processes import assert_each_slot_once, drain
from tests.failover.conftest import ProdStore
from tests.limits.test_rate_limits import publish, start_workers
from tests.support.cluster_topology import ClusterTopology
from tests.support.observer import Observer, Run, assert_no_overlap, max_concurrent
from tests.support.waiting import wait_until
from tests.support.workers import Workers


@pytest.fixture
def prod_store(cluster: ClusterTopology, cluster_url: str) -> ProdStore:
    return ProdStore("cluster", cluster_url, cluster)


def start(workers: Workers, app: str, n: int = 2, **kw: object) -> None:
    started = [workers.start(app, wait=False, **kw) for _ in range(n)]  # type: ignore[arg-type]
    for worker in started:
        worker.wait_ready()


def overlap_us(runs: Iterable[Run]) -> int:
    """The longest time two runs of one key were both running (0: never), in us."""
    worst = 0
    by_key: dict[str, list[Run]] = {}
    for run in runs:
        by_key.setdefault(run.key, []).append(run)
    for group in by_key.values():
        for a, b in itertools.combinations(group, 2):
            worst = max(worst, min(a.end, b.end) - max(a.start, b.start))
    return worst


def test_lease_renewed_past_its_ttl_keeps_a_long_run_alone(
    prod_workers: Workers, observer: Observer
) -> None:
    """A run of 7 s under a 2 s lease_ttl: only renewals keep the key (Gate.renew
    pipelines one renew script per hash tag on Cluster). A duplicate waits it out."""
    from tests.apps.exclusive import ex_long

    env = {"BATON_TEST_LEASE_TTL": "2"}
    start(prod_workers, "tests.apps.exclusive", concurrency=2, env=env)
    first = ex_long.delay("long", 7)
    observer.starts_of("long")
    second = ex_long.delay("long", 0)

    runs = observer.runs_of("long", 2, timeout=40)

    assert [r.task_id for r in sorted(runs, key=lambda r: r.start)] == [first.id, second.id]
    assert_no_overlap(runs)


def test_unique_second_publish_returns_the_first_id(
    prod_workers: Workers,
    observer: Observer,
    prod_store: ProdStore,
    use_store: Callable[[ModuleType, str], None],
) -> None:
    from tests.apps import exclusive

    use_store(exclusive, prod_store.url)
    start(prod_workers, "tests.apps.exclusive", n=1)
    first = exclusive.uq.delay("one", 1.5)
    observer.starts_of("one")
    assert exclusive.uq.delay("one", 0).id == first.id
    with prod_store.client() as store:
        assert store.get(exclusive.unique_key(exclusive.uq, "one")) == first.id
        assert first.get(timeout=20) == first.id
        wait_until(lambda: store.get(exclusive.unique_key(exclusive.uq, "one")) is None, 5, "freed")
    again = exclusive.uq.delay("one", 0)
    assert again.id != first.id
    assert again.get(timeout=20) == again.id


def test_a_debounced_burst_runs_once_with_the_last_arguments(
    prod_workers: Workers,
    observer: Observer,
    prod_store: ProdStore,
    use_store: Callable[[ModuleType, str], None],
) -> None:
    """The debounce scripts' keys share the task's hash tag: one slot, one call each."""
    from tests.apps import debounce

    use_store(debounce, prod_store.url)
    start(prod_workers, "tests.apps.debounce", n=1)
    results = [debounce.save.delay("cluster", v) for v in range(1, 6)]
    assert [r.get(timeout=20) for r in results] == [5] * 5
    time.sleep(1.5)  # a second run would come within one debounce
    runs = [r for r in observer.runs() if r.key == "save:cluster"]
    assert [r.task_id.rsplit("|", 1)[1] for r in runs] == ["5"]


def test_global_concurrency_cap(prod_workers: Workers, observer: Observer) -> None:
    from tests.apps import limits

    start_workers(prod_workers, 2, pool="prefork", concurrency=3)
    publish(limits.capped, 12, 0.3)

    runs = observer.wait_for(12, timeout=60)

    assert len(runs) == len(observer.started()) == 12
    assert max_concurrent(runs) == 2  # reached, never passed
    assert observer.max_running("capped") <= 2


def test_redelivery_guard_runs_each_id_once(prod_workers: Workers, observer: Observer) -> None:
    """A 2 s visibility timeout redelivers 5 s runs: the guard holds the copies."""
    from tests.apps import guard

    start(prod_workers, "tests.apps.guard", concurrency=3, env={"GUARD_VISIBILITY": "2"})
    ids = [guard.slow_guarded.delay(5).id for _ in range(3)]

    observer.wait_for(3, timeout=40)
    time.sleep(4)  # copies redelivered meanwhile would start now

    starts = observer.started()
    assert {i: sum(1 for s in starts if s["task_id"] == i) for i in ids} == dict.fromkeys(ids, 1)
    logs = "".join(w.log_text() for w in prod_workers.started)
    assert "already finished" in logs or "running elsewhere" in logs or "held" in logs, logs[-2000:]


# -- a master SIGKILLed mid-run -------------------------------------------------------------


class Stream:
    """Publishes ``task(key, sleep)`` over ``keys`` every ``every`` s in a thread."""

    def __init__(self, task: object, keys: list[str], sleep: float, every: float) -> None:
        self.ids: list[str] = []
        self._task, self._keys, self._sleep, self._every = task, keys, sleep, every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        for key in itertools.cycle(self._keys):
            if self._stop.is_set():
                return
            self.ids.append(self._task.delay(key, self._sleep).id)  # type: ignore[attr-defined]
            time.sleep(self._every)

    def __enter__(self) -> Stream:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture
def report_overlap() -> Iterator[list[str]]:
    lines: list[str] = []
    yield lines
    print("\n".join(lines))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_master_killed_workers_recover_nothing_lost(
    prod_workers: Workers,
    observer: Observer,
    cluster: ClusterTopology,
    report_overlap: list[str],
) -> None:
    """SIGKILL the master that serves ``ex_long``'s keys while runs stream in; its
    replica is promoted (node timeout 1 s). Every published task runs. The promoted
    replica may have been behind: the family's epoch says it was promoted, so no new
    lease is granted for one lease_ttl (3 s here) while the holders write theirs back;
    no two runs of a key overlap."""
    from tests.apps.exclusive import ex_long, exclusive_key

    start(prod_workers, "tests.apps.exclusive", concurrency=3, env={"BATON_TEST_LEASE_TTL": "3"})
    victim = cluster.master_of(exclusive_key(ex_long, "k0"))
    keys = [f"k{i}" for i in range(4)]
    with Stream(ex_long, keys, sleep=0.3, every=0.1) as stream:
        time.sleep(4)
        victim.kill()
        killed_us = int(time.time() * 1_000_000)
        time.sleep(10)
    published = list(stream.ids)

    runs = observer.wait_for(len(published), timeout=60)

    assert {r.task_id for r in runs} >= set(published)
    after = sorted(r.start for r in runs if r.start > killed_us)
    gap = (after[0] - killed_us) / 1e6 if after else float("inf")
    worst = overlap_us(runs)
    report_overlap.append(
        f"cluster master SIGKILL: {len(published)} published, all ran; first run "
        f"{gap:.2f} s after the kill; longest overlap of one key {worst / 1000:.0f} ms"
    )
    assert gap < 20
    assert_no_overlap(runs)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_beat_master_killed_beats_recover(
    prod_workers: Workers, observer: Observer, cluster: ClusterTopology, prod_store: ProdStore
) -> None:
    """SIGKILL the master serving the beat's keys under two beats: the beats go on
    on the promoted replica; every slot after the failover runs; duplicates measured."""
    env = beat_env(
        {"every1": {"every": 1, "options": {"baton_misfire": "all"}}}
    )  # each slot, caught up
    prod_workers.start("tests.apps.beat_app", env=env, concurrency=2)
    beats = start_two_beats(prod_workers, env)
    with prod_store.client() as store:
        wait_for_leader(store, beats)
    wait_for_slots(observer, "every1", 4, timeout=30)  # the leader fires
    cluster.master_of(BEAT_KEYS.leader).kill()
    killed_ms = int(time.time() * 1000)
    # The beats go on on the promoted replica, up to the count below.
    wait_for_slots(observer, "every1", 18, timeout=60)
    wait_for_slots(observer, "every1", 5, after_ms=killed_ms, timeout=60)
    for beat in beats:
        beat.stop()
    drain(observer, settle=2)
    assert_each_slot_once(observer, "every1", 1000, at_least=18)


@pytest.mark.timeout(180)  # three commands, each starting Celery
def test_the_cli_reads_leases_and_unique_claims_on_the_cluster(
    prod_workers: Workers,
    prod_store: ProdStore,
    observer: Observer,
    use_store: Callable[[ModuleType, str], None],
) -> None:
    """`celery baton status | locks | unlock` against a Cluster URL: the keys of every
    master are read (SCAN per node), a lease's key can be pasted into unlock."""
    import json
    import subprocess
    import sys

    from tests.apps import exclusive
    from tests.support.celery_processes import _process_env
    from tests.support.processes import REPO_ROOT

    use_store(exclusive, prod_store.url)
    worker = prod_workers.start("tests.apps.exclusive", concurrency=2)
    # Runs until killed below: three commands read and unlock its lease meanwhile,
    # each starting Celery (seconds apiece on a loaded machine).
    exclusive.mx_skip.delay("cli-cluster", "sleep", 300.0, 1)
    observer.starts_of("cli-cluster")

    def baton(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "celery", "-A", "tests.apps.exclusive", "baton", *args],
            env=_process_env(prod_workers.env),
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )

    status = json.loads(baton("status", "--json").stdout)
    assert status["store"].startswith("redis+cluster://") and status["leases"] == 1
    rows = json.loads(baton("locks", "--json").stdout)
    assert {r["kind"] for r in rows} == {"exclusive", "unique"}
    lease = next(r for r in rows if r["kind"] == "exclusive")
    done = baton("unlock", lease["key"], "--force", "--json")
    assert done.returncode == 0 and json.loads(done.stdout)["removed"] == 1, done.stderr
    worker.kill()


def test_locks_shows_ordered_and_batch_keys_on_the_cluster(
    prod_workers: Workers,
    prod_store: ProdStore,
    observer: Observer,
    use_store: Callable[[ModuleType, str], None],
) -> None:
    """`celery baton locks` on a Cluster URL: an ordered key's line (its record, its
    lease and its words, in its task's slot) and a batch key's calls (in the key's own
    slot) are read from every master."""
    import json
    import subprocess
    import sys

    from tests.apps import lines
    from tests.support.celery_processes import _process_env
    from tests.support.processes import REPO_ROOT

    use_store(lines, prod_store.url)  # publishes take their places there
    worker = prod_workers.start("tests.apps.lines", concurrency=2)
    first = lines.apply_event.delay("cl", 0, 60.0)  # runs until the worker is killed
    for n in (1, 2):
        lines.apply_event.delay("cl", n)
    for n in range(3):
        lines.index_docs.delay(account=5, doc=n)  # waits lines.BATCH_WAIT s
    observer.starts_of("apply:cl")

    def listing() -> list[dict[str, object]]:
        done = subprocess.run(
            [sys.executable, "-m", "celery", "-A", "tests.apps.lines", "baton", "locks", "--json"],
            env=_process_env(prod_workers.env),
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        rows: list[dict[str, object]] = json.loads(done.stdout)
        return rows

    rows = listing()
    [line] = [r for r in rows if r["kind"] == "ordered"]
    assert line["label"] == "apply_event(account='cl')" and line["queued"] == 2, line
    assert line["running"]["task_id"] == first.id, line  # type: ignore[index]
    [batch] = [r for r in rows if r["kind"] == "batch"]
    assert batch["label"] == "index_docs(account=5)" and batch["waiting"] == 3, batch
    worker.kill()
