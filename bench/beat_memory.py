"""What the store keeps for one beat entry after a simulated day (issue 28, item 12).

One 1 s entry fires 86,400 slots a day. Each slot goes through every store operation
of its life, as the beat and a worker call them: the leader's claim and its outbox
clearing (``beat_claim``, ``beat_sent``), the worker's admission (``gate``, under the
beat slot's ``run_once`` policy) and the run's end (``release``). Time is simulated
(the slots are a day of real instants, driven as fast as the store answers), so no
key expires during the run: what is counted is what a day of real time leaves.

Two ways of recording that a slot ran, side by side on fresh servers:

* ``per-id``: a done marker per slot's task id, kept a day -- what versions before the
  run record wrote for every slot (this version still does for a manual trigger and for
  a message from an older beat);
* ``series``: the entry's run record (policy/slot_runs.py), one key per entry.

Keys and bytes are counted over the whole server (it holds nothing else): ``MEMORY
USAGE`` summed over the keys, and the growth of ``INFO memory``'s
``used_memory_dataset`` (used_memory less the server's overhead: client buffers,
scripts).

    python bench/beat_memory.py            # a day (about a minute per mode)
    python bench/beat_memory.py --quick    # an hour
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import RedisServer, machine_note, parse_args, table
from celery_baton.beat.scheduler import slot_task_id
from celery_baton.beat.state import BeatState, Claim
from celery_baton.core.gate import Gate, Release
from celery_baton.core.keys import KeyNames
from celery_baton.core.leases import new_owner
from celery_baton.core.policy.model import TaskPolicy
from celery_baton.core.policy.per_call import BEAT_SLOT_RETENTION
from celery_baton.core.policy.plan import plan_delivery
from celery_baton.core.policy.slot_runs import SlotRun
from celery_baton.store.connection import connect

TASK = "proj.tick"
ENTRY = "tick"
APP = "proj"
EVERY_MS = 1000
BATCH = 900  # slots per round trip (divides every checkpoint)
HISTORY = 20  # baton_beat_history's default
CHECKPOINTS = {"15 min": 900, "1 h": 3600, "1 day": 86_400}


def measure(client: Any, base_memory: int) -> tuple[int, int, int]:
    """(keys, MEMORY USAGE summed, used_memory_dataset growth) of the whole server."""
    keys = list(client.scan_iter(count=10_000))
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.memory_usage(key, samples=0)
    usage = sum(int(n or 0) for n in pipe.execute())
    return len(keys), usage, int(client.info("memory")["used_memory_dataset"]) - base_memory


class Day:
    """One entry of one app, its slots driven through the beat's and the worker's calls."""

    def __init__(self, store: Any, mode: str, app: str = APP) -> None:
        self.store, self.mode, self.app = store, mode, app
        self.beat, self.gate, self.names = BeatState(store, app=app), Gate(store), KeyNames()
        self.policy = TaskPolicy(
            name=TASK,
            lease_ttl=30.0,
            redelivery_guard=True,
            redelivery_retention=BEAT_SLOT_RETENTION,
        )
        self.fence = self.beat.lead("beat-1", 3_600_000).fence
        self.start = (int(time.time()) - 86_400) * 1000
        self.before: int | None = None
        self.beat.define(
            owner="beat-1",
            fence=self.fence,
            mode="sync",
            name=ENTRY,
            fingerprint="fp",
            next_slot=self.start,
            edited_line="{}",
            history_max=HISTORY,
            fields={"source": "config", "task": TASK},
        )

    def run(self, first: int, count: int) -> None:
        """Slots ``first`` to ``first + count - 1``: claimed, sent, admitted, ended."""
        beat, store, app, before = self.beat, self.store, self.app, self.before
        pipe = store.client.pipeline(transaction=False)
        plans = []
        for i in range(first, first + count):
            slot = self.start + i * EVERY_MS
            task_id = slot_task_id("baton", ENTRY, slot, app=app)
            item = {"entry": ENTRY, "slot": slot, "kind": "fired", "before": before}
            line = {"at": slot, "kind": "fired", "slot": slot, "id": task_id}
            claim = Claim(
                name=ENTRY,
                expected_next=slot,
                fingerprint="fp",
                new_next=slot + EVERY_MS,
                trigger="",
                last_slot=slot,
                last_id=task_id,
                expected_last=before,
                outbox=[(task_id, json.dumps(item))],
                history=[json.dumps(line)],
                fired=1,
                missed=0,
                suppressed=0,
            )
            beat.claim("beat-1", self.fence, claim, HISTORY, pipe)
            store.scripts.run("beat_sent", [beat.keys.outbox], [task_id], client=pipe)
            run = SlotRun(app, ENTRY, slot, before) if self.mode == "series" else None
            owner = new_owner(task_id, "w@h")
            plan = plan_delivery(
                self.policy,
                self.names,
                task_id=task_id,
                owner=owner,
                args=(),
                kwargs={},
                slot_run=run,
            )
            plans.append(plan)
            before = slot
        self.before = before
        replies = pipe.execute()
        assert all(int(r[0]) == 1 for r in replies[::2]), replies[:4]
        calls = [self.gate.call(p.conditions, p.owner, 30.0, 0.0) for p in plans]
        decided = store.scripts.call_many("gate", calls)
        assert all(int(d[0]) == 1 for d in decided), decided[:2]
        self.gate.release_many(
            [
                Release(
                    tuple(lease.key for lease in p.leases),
                    p.owner,
                    p.done_key,
                    self.policy.redelivery_retention,
                    done_link=p.done_link,
                )
                for p in plans
            ]
        )


def simulate(mode: str, slots: int) -> list[tuple[str, int, int, int]]:
    """One entry's ``slots`` one-second slots under ``mode``; a row per checkpoint."""
    rows = []
    with RedisServer() as server:
        store = connect(server.url)
        client = store.client
        Day(store, mode, app="warm-up").run(0, 10)  # loads the scripts (server memory)
        client.flushall()
        day = Day(store, mode)
        time.sleep(0.2)
        base_memory = int(client.info("memory")["used_memory_dataset"])
        marks = {n: label for label, n in CHECKPOINTS.items() if n <= slots}
        for first in range(0, slots, BATCH):
            day.run(first, min(BATCH, slots - first))
            done = min(first + BATCH, slots)
            if done in marks:
                rows.append((marks[done], *measure(client, base_memory)))
        if slots <= 3600:
            print(f"{mode}: {sorted(client.scan_iter(count=10_000))[:12]}", file=sys.stderr)
        client.close()
    return rows


def main() -> None:
    args = parse_args(__doc__.split("\n", 1)[0])
    slots = 3600 if args.quick else 86_400
    print(f"# one {EVERY_MS / 1000:g} s beat entry, {slots} slots simulated\n")
    print(machine_note(), "\n")
    rows = []
    for mode in ("per-id", "series"):
        began = time.monotonic()
        for label, keys, usage, grown in simulate(mode, slots):
            rows.append((mode, label, f"{keys:,}", f"{usage:,}", f"{grown:,}"))
        print(f"{mode}: {time.monotonic() - began:.0f} s", file=sys.stderr)
    headers = ("done record", "after", "keys", "MEMORY USAGE (bytes)", "used_memory_dataset growth")
    print(table(headers, rows))


if __name__ == "__main__":
    main()
