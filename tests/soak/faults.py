"""The faults the nemesis injects, on a seeded random schedule.

The nemesis draws a fault every few seconds from ``random.Random(seed)``: SIGKILL a pool
child, SIGKILL a worker (restarted after a moment), SIGSTOP the store or the broker for a
while (sometimes longer than ``lease_ttl``), SIGKILL and restart the store or the broker,
SIGKILL the beat leader (restarted), edit the runtime schedule (add, update, pause,
resume, remove an entry) and re-publish a copy of a redelivery-guarded message (its
task id and publish stamp, as a broker delivers it again). Each fault is
recorded with the observer server's clock.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from celery_baton.core.policy.headers import PUBLISH_HEADER
from tests.soak.checker import Fault
from tests.soak.config import SoakConfig
from tests.soak.machines import APP, Clock, Machine
from tests.support.servers import StoreServer


class Faults:
    """The faults, a part of :class:`tests.soak.nemesis.Nemesis`: :meth:`faults_table`
    names each by its kind (as ``SoakConfig.weights`` does). A republish sends through
    the publishers (:class:`tests.soak.workload.Workload`); after each fault the dead
    are started again (:class:`tests.soak.machines.Watcher`)."""

    # The Nemesis's state that the faults read and write.
    config: SoakConfig
    rng: random.Random
    clock: Clock
    machines: list[Machine]
    store: StoreServer
    broker: StoreServer
    app: Any
    faults: list[Fault]
    guarded_ids: list[tuple[str, float, str]]
    _lock: threading.Lock
    _procs: threading.RLock
    _killed: set[int]
    _api_entry: str | None

    def _fault_loop(self) -> None:
        faults = self.faults_table()
        kinds = list(self.config.weights)
        weights = [self.config.weights[k] for k in kinds]
        deadline = time.monotonic() + self.config.fault_seconds
        while True:
            gap = self.rng.uniform(*self.config.gap)
            if time.monotonic() + gap >= deadline:
                break
            time.sleep(gap)
            kind = self.rng.choices(kinds, weights)[0]
            try:
                faults[kind]()
            except Exception as exc:  # a fault that could not be injected is no verdict
                print(f"nemesis: {kind} failed: {exc!r}", flush=True)
            self._restart_dead()
        time.sleep(max(0.0, deadline - time.monotonic()))

    def faults_table(self) -> dict[str, Callable[[], None]]:
        return {
            "kill_child": self.kill_child,
            "kill_worker": self.kill_worker,
            "pause_store": lambda: self._pause(self.store, "pause_store"),
            "restart_store": lambda: self._restart(self.store, "restart_store"),
            "pause_broker": lambda: self._pause(self.broker, "pause_broker"),
            "restart_broker": lambda: self._restart(self.broker, "restart_broker"),
            "kill_beat": self.kill_beat,
            "edit": self.edit_schedule,
            "republish": self.republish,
        }

    def _record(self, kind: str, start: int, pids: tuple[int, ...] = (), detail: str = "") -> None:
        fault = Fault(kind, start, self.clock.now(), pids, detail)
        self.faults.append(fault)
        # The start on the clock the publishes and runs are recorded on: a finding's times
        # can then be read against the faults from the printed output alone.
        print(f"nemesis: {kind} {detail} at {start} ({fault.length / 1e6:.2f} s)", flush=True)

    def kill_child(self) -> None:
        live = [m.worker for m in self.machines if m.worker and m.worker.is_running]
        if not live:
            return
        worker = self.rng.choice(live)
        children = worker.pool_pids()
        if not children:
            return
        pid = self.rng.choice(sorted(children))
        start = self.clock.now()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        self._record("kill_child", start, (pid,), f"{worker.hostname} child {pid}")

    def kill_worker(self) -> None:
        machine = self.rng.choice(self.machines)
        down = self.rng.uniform(1.0, 3.0)
        with self._procs:
            worker = machine.worker
            if worker is None or not worker.is_running:
                return
            pids = (worker.pid, *worker.pool_pids())
            start = self.clock.now()
            self._killed.add(worker.pid)
            worker.kill()
        self._record("kill_worker", start, pids, f"{worker.hostname}, restarted after {down:.1f} s")
        time.sleep(down)
        with self._procs:
            machine.start_worker()

    def kill_beat(self) -> None:
        down = self.rng.uniform(1.0, 3.0)
        beats = [m for m in self.machines if m.beat and m.beat.is_running]
        if not beats:
            return
        leader = self._leader_pid()
        chosen = next((m for m in beats if m.beat and m.beat.pid == leader), None)
        machine = chosen or self.rng.choice(beats)
        assert machine.beat is not None
        with self._procs:
            pid = machine.beat.pid
            start = self.clock.now()
            self._killed.add(pid)
            machine.beat.kill()
        what = "leader" if chosen else "a beat (no leader found)"
        self._record("kill_beat", start, (pid,), f"{what} pid {pid}, restarted after {down:.1f} s")
        time.sleep(down)
        with self._procs:
            machine.start_beat()

    def _leader_pid(self) -> int | None:
        """The pid in the beat leader lease's owner (``host:pid:nonce``), if the store
        answers; the lease key is found by its shape, not by its name."""
        try:
            with self.store.client() as r:
                for key in r.scan_iter(match="*leader*", count=1000):
                    if r.type(key) == "hash":
                        owner = r.hget(key, "owner")
                        if owner and owner.count(":") >= 2:
                            return int(owner.split(":")[-2])
        except (redis.RedisError, ValueError):
            return None
        return None

    def _pause(self, server: StoreServer, kind: str) -> None:
        # Now and then longer than lease_ttl: leases run out while their runs go on,
        # the documented "lease lost" window (docs/failure.md).
        if self.rng.random() < 0.15:
            length = self.config.lease_ttl + self.rng.uniform(1.0, 2.0)
        else:
            length = self.rng.uniform(0.5, 3.0)
        start = self.clock.now()
        server.pause()
        try:
            time.sleep(length)
        finally:
            server.resume()
        self._record(kind, start, detail=f"SIGSTOP {length:.1f} s")

    def _restart(self, server: StoreServer, kind: str) -> None:
        down = self.rng.uniform(0.5, 2.0)
        start = self.clock.now()
        server.restart(kill=True, down_for=down)
        self._record(kind, start, detail=f"SIGKILL, down {down:.1f} s, same data (AOF)")

    def edit_schedule(self) -> None:
        from celery_baton.beat.api import ScheduleStore
        from celery_baton.store.connection import connect

        name = "api2"
        if self._api_entry is None:
            op = "add"
        else:
            ops = ["update", "remove", "resume" if self._api_entry == "paused" else "pause"]
            op = self.rng.choice(ops)
        every = self.rng.choice([1.0, 2.0, 3.0])
        start = self.clock.now()
        # The store's URL is given explicitly: this process must not start a store of its
        # own whatever the app's settings resolve to.
        with ScheduleStore(self.app, store=connect(self.store.url(0), socket_timeout=2)) as api:
            if op == "add":
                api.add(name, f"{APP}.tick", every, args=[name])
                self._api_entry = "on"
            elif op == "update":
                api.update(name, schedule=every)
            elif op == "remove":
                api.remove(name)
                self._api_entry = None
            elif op == "pause":
                api.pause(name)
                self._api_entry = "paused"
            else:
                api.resume(name)
                self._api_entry = "on"
        detail = f"{op} {name}" + (f" every {every:g} s" if op in ("add", "update") else "")
        self._record("edit", start, detail=detail)

    def republish(self) -> None:
        with self._lock:
            if not self.guarded_ids:
                return
            task_id, sleep, stamp = self.rng.choice(self.guarded_ids)
        start = self.clock.now()
        copy = {PUBLISH_HEADER: stamp}  # the same message again, as a redelivery
        self._send("guarded", (sleep,), task_id=task_id, detail="republished", headers=copy)
        self._record("republish", start, detail=f"guarded {task_id}")
