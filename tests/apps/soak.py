"""The nemesis soak's Celery app: every kind of coordination, each run recorded from outside.

Run by workers and beats as ``celery -A tests.apps.soak worker|beat`` (see
:mod:`tests.soak.nemesis`). Reads from the environment:

* ``SOAK_STORE_URL`` -- the store under test, given as ``Baton(app, url=...)`` only (not
  as ``$BATON_URL``): the way a user deploys it, so that every part (worker, beat) must
  resolve the store from there;
* ``TEST_BROKER_URL`` -- the broker (a server the nemesis pauses and restarts);
* ``TEST_RESULT_URL`` and ``TEST_OBSERVER_URL`` -- results and the observer, on a server
  the nemesis never touches;
* ``SOAK_LEASE_TTL`` -- the ``lease_ttl`` of every task (default 6 s: a killed worker's
  keys come back within seconds).

The deployment a user runs, not a tidy one: prefetch as Celery ships it (4 per pool
process), and a plain task, :func:`busy`, that the nemesis publishes in surges so that
guarded requests often meet pools with no free process (issue 24, section 4).

Every task is ``acks_late`` with ``reject_on_worker_lost`` (except the beat tick), so a
killed pool child or worker loses no message: the broker gives it back (at once for a
lost child, after ``visibility_timeout`` for a killed worker) and it runs again. Each run
reports itself to the :class:`~tests.support.observer.Observer` (server clock) under a key
that names its kind; exclusive runs carry ``fence()``. Every skip is recorded from the
``task_skipped`` signal in the worker's main process with the server's clock, so the
checker can account for each published id that did not run.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

import redis
from celery import Task

from celery_baton import Call, fence
from celery_baton.signals import task_skipped
from tests.apps.factory import make_baton_app, observer

LEASE_TTL = float(os.environ.get("SOAK_LEASE_TTL", "6"))
#: The broker gives back an unacknowledged message after this long (a killed worker's).
VISIBILITY = 15.0
CAP = 2
RATE = 4.0  # per second
BURST = 2
#: Where the worker's main process records skips (observer server, observer db).
SKIPPED = "soak:skipped"
#: ``ordered_gap_timeout`` of :func:`inorder` (seconds): above the broker's redelivery of a
#: killed worker's messages (VISIBILITY, then a restore each second), so a killed call
#: comes back before its position is skipped, and short enough to drain a key that lost
#: a call (kombu's transport window) within the soak's drain.
ORDERED_GAP = 30.0
#: :func:`batched`'s batches: up to this many calls of one key, or ``BATCH_WAIT`` s after the
#: first of them arrived.
BATCH_SIZE = 5
BATCH_WAIT = 0.3

app, baton = make_baton_app(
    "soak",
    # The store given as Baton(app, url=...) only (not as $BATON_URL): the way a user
    # deploys it, so that every part (worker, beat) must resolve the store from there.
    store_from_env=False,
    url=os.environ["SOAK_STORE_URL"],
    baton_socket_timeout=1.0,
    # Held deliveries go back to the broker well before it would redeliver them itself.
    baton_hold_horizon=VISIBILITY / 3,
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    # worker_prefetch_multiplier as Celery ships it (4): each worker reserves 4 messages
    # per pool process, so guarded requests wait behind plain ones as in production.
    worker_lost_wait=1.0,
    result_expires=None,
    broker_transport_options={
        "visibility_timeout": VISIBILITY,
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
        # kombu's restore takes a mutex on the broker for this long; a broker that was
        # SIGSTOPped past socket_timeout runs the SET after the client gave up, and the
        # mutex then blocks every restore (a killed worker's messages) for its whole
        # expiry (default 300 s). A restore takes milliseconds here.
        "unacked_mutex_expire": 5,
        "socket_timeout": 5,
        "socket_connect_timeout": 5,
    },
    beat_schedule={
        "every1": {"task": "tests.apps.soak.tick", "schedule": 1.0, "args": ("every1",)},
    },
    beat_scheduler="celery_baton.beat:Scheduler",
    beat_max_loop_interval=1,
)

_SKIP_SCRIPT = """
local t = redis.call('TIME')
local now = t[1] .. string.rep('0', 6 - #t[2]) .. t[2]
redis.call('RPUSH', KEYS[1], '{"at":' .. now .. ',' .. string.sub(ARGV[1], 2))
return now
"""


@functools.cache
def _skip_recorder() -> Any:
    client = redis.Redis.from_url(os.environ["TEST_OBSERVER_URL"], socket_timeout=10)
    return client.register_script(_SKIP_SCRIPT)


@task_skipped.connect
def _record_skip(
    sender: Any = None,
    request: Any = None,
    key: str = "",
    holder: str = "",
    reason: str = "",
    **_: Any,
) -> None:
    """Record a skip outside the library: ``{at, task_id, task, reason, key, holder}``."""
    entry = {
        "task_id": getattr(request, "id", ""),
        "task": getattr(sender, "name", ""),
        "reason": reason,
        "key": key,
        "holder": holder,
        "pid": os.getpid(),
    }
    _skip_recorder()(keys=[SKIPPED], args=[json.dumps(entry)])


_LATE = {"acks_late": True, "reject_on_worker_lost": True, "lease_ttl": LEASE_TTL}


@app.task(bind=True, exclusive="key", **_LATE)
def ex_skip(self: Task, key: str, sleep: float) -> None:
    """Exclusive on ``key``; a duplicate is skipped (TaskSkipped result)."""
    observer().run(f"ex_skip:{key}", fence(), sleep=sleep, task_id=self.request.id)


@app.task(bind=True, exclusive="key", exclusive_conflict="wait", **_LATE)
def ex_wait(self: Task, key: str, sleep: float) -> None:
    """Exclusive on ``key``; a duplicate waits in the consumer."""
    observer().run(f"ex_wait:{key}", fence(), sleep=sleep, task_id=self.request.id)


@app.task(bind=True, global_concurrency=CAP, **_LATE)
def capped(self: Task, n: int, sleep: float) -> None:
    """At most ``CAP`` running anywhere."""
    observer().run("capped", sleep=sleep, task_id=self.request.id)


# ``exclusive="n"`` with a distinct ``n`` per publish is a lease that is always free, whose
# fence is the store's TIME (microseconds) in the gate call that admitted the run. The
# checker judges the rate twice: on these admission instants, and on the runs' starts
# (the observer's stamp at the body's first line), where the user meets the limit.
@app.task(
    bind=True,
    global_rate_limit=f"{RATE:g}/s",
    global_rate_limit_burst=BURST,
    exclusive="n",
    **_LATE,
)
def rated(self: Task, n: int) -> None:
    """``RATE`` starts per second across all workers, burst ``BURST``."""
    observer().run("rated", fence(), task_id=self.request.id)


@app.task(bind=True, unique="key", **_LATE)
def uq(self: Task, key: str, sleep: float) -> None:
    """Unique until finished: a publish while one is queued or running is deduplicated."""
    observer().run(f"uq:{key}", sleep=sleep, task_id=self.request.id)


@app.task(bind=True, redelivery_guard=True, **_LATE)
def guarded(self: Task, sleep: float) -> None:
    """Redelivery guard: one task id never runs twice (the nemesis re-publishes ids)."""
    observer().run(f"guarded:{self.request.id}", sleep=sleep, task_id=self.request.id)


@app.task(bind=True)
def busy(self: Task, sleep: float) -> None:
    """Plain work, no celery-baton option: occupies a pool process for ``sleep`` seconds,
    so that guarded requests arrive while every process is busy (as on a real worker)."""
    observer().run("busy", sleep=sleep, task_id=self.request.id)


@app.task(bind=True)
def tick(self: Task, entry: str) -> None:
    """A beat entry's run, keyed ``beat:<entry>|<slot ms>`` (slot from the message)."""
    slot = getattr(self.request, "baton_beat_slot", None)
    observer().run(f"beat:{entry}|{slot}", task_id=self.request.id)


@app.task(bind=True, ordered="key", ordered_gap_timeout=ORDERED_GAP, **_LATE)
def inorder(self: Task, key: str, seq: int, sleep: float) -> int:
    """Call ``seq`` of ordered ``key`` (the publisher numbers each key's calls in its
    publish order): one at a time per key, in publish order, on any worker."""
    observer().run(f"inorder:{key}", sleep=sleep, task_id=self.request.id)
    return seq


@app.task(batch="key", batch_size=BATCH_SIZE, batch_wait=BATCH_WAIT, **_LATE)
def batched(calls: list[Call]) -> list[str]:
    """Calls of one ``key`` run together; one observed run per batch, keyed
    ``batched:<the keys of its calls>`` (``|``-joined: a run that mixed keys shows it), its
    call ids ``,``-joined as its task id. Each call's result names its own call:
    ``<key>:<n>:<call id>``."""
    keys = "|".join(sorted({str(c.kwargs.get("key")) for c in calls}))
    sleep = max(float(c.kwargs.get("sleep", 0.0)) for c in calls)
    observer().run(f"batched:{keys}", task_id=",".join(c.id for c in calls), sleep=sleep)
    return [f"{c.kwargs['key']}:{c.kwargs['n']}:{c.id}" for c in calls]


#: :func:`cancelled_rated`'s global rate limit (per second): the publisher sends it in
#: groups, so some calls are held in the workers when their cancel comes.
CANCEL_RATE = 3.0


@app.task(bind=True, **_LATE)
def cancelled(self: Task, key: str, sleep: float) -> str:
    """Plain (nothing asked of the gate); the publisher cancels some calls with
    ``baton.cancel`` (by id, or by ``key``: a key reserved for that cancel)."""
    observer().run(f"cancelled:{key}", sleep=sleep, task_id=self.request.id)
    return key


@app.task(bind=True, global_rate_limit=f"{CANCEL_RATE:g}/s", **_LATE)
def cancelled_rated(self: Task, key: str, sleep: float) -> str:
    """:func:`cancelled` behind a global rate limit (guarded: its gate call checks the
    cancel); published in groups, so that some calls are held in a worker."""
    observer().run(f"cancelled_rated:{key}", sleep=sleep, task_id=self.request.id)
    return key
