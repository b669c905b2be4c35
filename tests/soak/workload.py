"""The soak's workload: the publishers that send its tasks and record what they were told.

A publisher thread sends every kind of task at a moderate rate and records what it sent
and what it was told (deduplicated into which id, or the publish failed). A second one
sends plain ``busy`` tasks in surges that take every pool process for seconds at a
time, so that guarded requests meet saturated pools, as on a real worker.

Ordered calls (``inorder``) carry their key's sequence number, counted by this one
publisher thread in its publish order (a failed publish takes its number too: the
checker reads each call's from what was recorded). Batched calls (``batched``) come in
bursts of one key, so that some batches fill and others run on their wait.

Cancelled calls (the ``cancelled`` kind: a plain task and a rate-limited one, some with a
countdown) are cancelled with ``baton.cancel`` by id, about one in two, 0-2 s after their
publish (a timer thread; the delay drawn from the seeded stream); now and then a group of
calls of a key reserved for it is cancelled by key. Each cancel is recorded with the
moment it returned (or raised: then it is not judged).
"""

from __future__ import annotations

import random
import secrets
import threading
import time
import uuid
from typing import Any

from celery_baton.core.policy.headers import PUBLISH_HEADER
from tests.soak.checker import Cancel, Published
from tests.soak.config import SoakConfig
from tests.soak.machines import Clock


class Workload:
    """The publishers, a part of :class:`tests.soak.nemesis.Nemesis` (run as its threads)."""

    # The Nemesis's state that the publishers read and write.
    config: SoakConfig
    publish_rng: random.Random
    busy_rng: random.Random
    clock: Clock
    module: Any
    published: list[Published]
    guarded_ids: list[tuple[str, float, str]]
    cancels: list[Cancel]
    _stop_publishing: threading.Event
    _lock: threading.Lock

    def _publish_loop(self) -> None:
        rng = self.publish_rng
        weighted = {
            "ex_skip": 2, "ex_wait": 2, "capped": 2, "uq": 2, "guarded": 1.5, "rated": 1.5,
            "inorder": 2.5, "batched": 1.5, "cancelled": 2.5,
        }  # fmt: skip
        kinds = [k for k in weighted if not self.config.only or k in self.config.only]
        if not kinds:
            return  # --only busy
        weights = [weighted[k] for k in kinds]
        seqs: dict[str, int] = {}
        timers: list[threading.Timer] = []
        try:
            self._publish_kinds(rng, kinds, weights, seqs, timers)
        finally:
            for timer in timers:  # the cancels still due: made, and recorded
                timer.join(timeout=10)

    def _publish_kinds(
        self,
        rng: random.Random,
        kinds: list[str],
        weights: list[float],
        seqs: dict[str, int],
        timers: list[threading.Timer],
    ) -> None:
        n = 0
        while not self._stop_publishing.wait(rng.uniform(*self.config.publish_gap)):
            kind = rng.choices(kinds, weights)[0]
            n += 1
            if kind == "ex_skip":
                self._send(kind, (rng.choice("ab"), round(rng.uniform(0.2, 1.5), 2)))
            elif kind == "ex_wait":
                self._send(kind, (rng.choice("ab"), round(rng.uniform(0.2, 1.0), 2)))
            elif kind == "capped":
                self._send(kind, (n, round(rng.uniform(0.5, 2.0), 2)))
            elif kind == "uq":
                # Half of them with expires= shorter than some runs (issue 11, item 4).
                expiring = rng.random() < 0.5
                args = (rng.choice("abc"), round(rng.uniform(0.5, 3.0), 2))
                if expiring:
                    self._send(kind, args, detail="expires=2", expires=2)
                else:
                    self._send(kind, args)
            elif kind == "guarded":
                sleep = round(rng.uniform(0.2, 1.0), 2)
                stamp = secrets.token_hex(8)  # not from rng: the seeded stream is kept
                task_id = self._send(kind, (sleep,), headers={PUBLISH_HEADER: stamp})
                if task_id:
                    with self._lock:
                        self.guarded_ids.append((task_id, sleep, stamp))
            elif kind == "inorder":
                key = rng.choice("pqr")
                seqs[key] = seqs.get(key, 0) + 1
                args = (key, seqs[key], round(rng.uniform(0.02, 0.4), 2))
                self._send(kind, args, detail=f"key={key} seq={seqs[key]}")
            elif kind == "batched":
                key = rng.choice("xyz")
                sleep = round(rng.uniform(0.05, 0.5), 2)
                for _ in range(rng.randint(1, 7)):
                    n += 1
                    kwargs = {"key": key, "n": n, "sleep": sleep}
                    self._send(kind, (), kwargs=kwargs, detail=f"key={key} n={n}")
            elif kind == "cancelled":
                n += 1
                self._publish_cancelled(rng, n, timers)
            else:
                # Groups of up to 8 (admitted over up to 1.5 s at 4/s, burst 2): a group
                # that meets a saturated pool shows whether the limit holds at the start.
                for _ in range(rng.randint(1, 8)):
                    n += 1
                    self._send(kind, (n,))

    def _publish_cancelled(self, rng: random.Random, n: int, timers: list[threading.Timer]) -> None:
        """Calls of :func:`tests.apps.soak.cancelled` (plain) or ``cancelled_rated`` (held
        by its rate when several come at once), some with a countdown. About one in two is
        cancelled by id 0-2 s after its publish; one time in eight a group of calls of a
        key of its own (``k<n>``) is cancelled by key, 0-2 s after the last of them."""
        task = rng.choice(("cancelled", "cancelled_rated"))
        by_key = rng.random() < 0.125
        key = f"k{n}" if by_key else rng.choice("abc")
        for _ in range(rng.randint(1, 4)):
            sleep = round(rng.uniform(0.05, 0.6), 2)
            countdown = round(rng.uniform(0.5, 4.0), 2) if rng.random() < 0.25 else None
            cancel = not by_key and rng.random() < 0.5
            delay = rng.uniform(0.0, 2.0)
            options: dict[str, Any] = {"countdown": countdown} if countdown else {}
            detail = f"key={key}" + (f" countdown={countdown:g}" if countdown else "")
            task_id = self._send(task, (key, sleep), detail=detail, **options)
            if task_id and cancel:
                timers.append(self._cancel_later(delay, task_id=task_id))
        if by_key:
            timers.append(self._cancel_later(rng.uniform(0.0, 2.0), task=task, key=key))

    def _cancel_later(
        self, delay: float, *, task_id: str = "", task: str = "", key: str = ""
    ) -> threading.Timer:
        timer = threading.Timer(
            delay, self._cancel, kwargs={"task_id": task_id, "task": task, "key": key}
        )
        timer.daemon = True
        timer.start()
        return timer

    def _cancel(self, *, task_id: str = "", task: str = "", key: str = "") -> None:
        """``baton.cancel`` by id, or by key; recorded with the moment it returned."""
        baton = self.module.baton
        try:
            if task_id:
                done = baton.cancel(task_id)
            else:
                done = baton.cancel(task=getattr(self.module, task), key={"key": key})
        except Exception as exc:
            at = self.clock.now()
            self.cancels.append(Cancel(at, task_id, task, key, failed=True, detail=repr(exc)[:300]))
            return
        at = self.clock.now()
        self.cancels.append(Cancel(at, task_id, task, key, ttl=done.ttl, detail=done.what))

    def _busy_loop(self) -> None:
        """Plain ``busy`` tasks in surges and calms (``SoakConfig.busy_*``)."""
        rng, config = self.busy_rng, self.config
        surge = True
        while not self._stop_publishing.is_set():
            length = config.busy_surge if surge else config.busy_calm
            until = time.monotonic() + rng.uniform(*length)
            gap = config.busy_surge_gap if surge else config.busy_calm_gap
            while time.monotonic() < until:
                if self._stop_publishing.wait(rng.uniform(*gap)):
                    return
                self._send("busy", (round(rng.uniform(*config.busy_sleep), 2),))
            surge = not surge

    def _send(
        self,
        kind: str,
        args: tuple[Any, ...],
        *,
        task_id: str | None = None,
        detail: str = "",
        **options: Any,
    ) -> str | None:
        """Publish one task and record what the publisher was told; its id if it was sent."""
        task = getattr(self.module, kind)
        task_id = task_id or str(uuid.uuid4())
        at = self.clock.now()
        try:
            result = task.apply_async(args, task_id=task_id, **options)
        except Exception as exc:
            self.published.append(
                Published(task_id, kind, at, "failed", detail=f"{detail} {exc!r}"[:300])
            )
            return None
        if result.id != task_id:
            self.published.append(
                Published(task_id, kind, at, "deduplicated", into=result.id, detail=detail)
            )
            return None
        self.published.append(Published(task_id, kind, at, "sent", detail=detail))
        return task_id
