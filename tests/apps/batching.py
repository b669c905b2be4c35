"""A Celery app with celery-baton installed: batched tasks under test (issue 37).

Run by workers as ``celery -A tests.apps.batching worker``. Reads the servers from the
environment (tests/apps/factory.py) and ``BATCH_VISIBILITY``: the Redis broker's
``visibility_timeout`` (a test that kills a worker sets a few seconds, so its held
messages come back soon); ``BATCH_ACKS_LATE``: set, ``task_acks_late`` is on;
``BATCH_LEASE_TTL``: the ``baton_lease_ttl`` (8 s by default), how long a run and a
worker's presence outlive their last renewal; ``BATCH_RESULT_EXTENDED``: set,
``result_extended`` is on; ``BATCH_QUEUE``: the default queue (``celery``; a RabbitMQ
test uses one of its own), ``BATCH_QUEUE_TYPE`` its type on RabbitMQ (``quorum``);
``BATCH_SLOW_EXIT``: seconds a leaving pool process takes to exit (its
``worker_process_shutdown`` handler sleeps: with ``--max-tasks-per-child`` its
replacement comes that much later). A named limit, ``"partner"``, for the
batched tasks that spend it (``limits=``, ``cost=``).

Every batch run reports to the observer under ``"<task>:<keys of its calls>"`` (one
key, or several joined by ``|``: a run that mixed keys shows it), with its call ids
joined by ``,`` in the run's task id field.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Task, signals
from kombu import Queue

from celery_baton import Call
from celery_baton.core.batch import batch_keys
from celery_baton.core.keys import digest
from tests.apps.factory import make_baton_app, observer

VISIBILITY = float(os.environ.get("BATCH_VISIBILITY", "3600"))
#: A partner API's budget of calls: 10 a second, 5 back to back.
PARTNER = {"rate": "10/s", "burst": 5}

app, baton = make_baton_app(
    "batching",
    baton_socket_timeout=1.0,
    task_acks_late=bool(os.environ.get("BATCH_ACKS_LATE")),
    result_extended=bool(os.environ.get("BATCH_RESULT_EXTENDED")),
    broker_transport_options={
        "visibility_timeout": VISIBILITY,
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    },
    worker_lost_wait=1.0,
    baton_lease_ttl=float(os.environ.get("BATCH_LEASE_TTL", "8")),
    baton_limits={"partner": PARTNER},
    task_default_queue=os.environ.get("BATCH_QUEUE", "celery"),
)
if os.environ.get("BATCH_QUEUE_TYPE"):  # a RabbitMQ queue of that type (quorum)
    app.conf.task_queues = [
        Queue(
            app.conf.task_default_queue,
            queue_arguments={"x-queue-type": os.environ["BATCH_QUEUE_TYPE"]},
        )
    ]

_SLOW_EXIT = float(os.environ.get("BATCH_SLOW_EXIT", "0"))
if _SLOW_EXIT:

    @signals.worker_process_shutdown.connect(weak=False)
    def _exit_slowly(**_: Any) -> None:
        time.sleep(_SLOW_EXIT)


def _report(task: str, calls: list[Call], sleep: float = 0.05) -> None:
    keys = "|".join(sorted({str(c.kwargs.get("account")) for c in calls}))
    observer().run(f"{task}:{keys}", task_id=",".join(c.id for c in calls), sleep=sleep)


@app.task(batch="account", batch_size=10, batch_wait=0.2)
def index(calls: list[Call]) -> list[int]:
    """Batches of up to 10 calls of one account, 0.2 s after the first: doc * 2 each."""
    _report("index", calls)
    return [c.kwargs["doc"] * 2 for c in calls]


@app.task(batch="account", batch_size=50, batch_wait=0.2)
def wide(calls: list[Call]) -> list[int]:
    """Batches of up to 50 calls (the issue's scale test)."""
    _report("wide", calls, sleep=0.01)
    return [c.kwargs["doc"] * 2 for c in calls]


@app.task(batch="account", batch_size=10, batch_wait=1.0)
def fill(calls: list[Call]) -> list[int]:
    """As ``index`` with a 1 s wait: a burst published within it makes full batches."""
    _report("fill", calls)
    return [c.kwargs["doc"] * 2 for c in calls]


@app.task(batch="account", batch_size=1000, batch_wait=8.0)
def patient(calls: list[Call]) -> list[int]:
    """Calls wait 8 s: long enough to be seen waiting."""
    _report("patient", calls)
    return [c.kwargs["doc"] for c in calls]


@app.task(batch="account", batch_size=1000, batch_wait=2.0)
def slow_fill(calls: list[Call]) -> list[int]:
    """Never full: a batch runs 2 s after its first call (calls wait that long)."""
    _report("slow_fill", calls)
    return [c.kwargs["doc"] * 2 for c in calls]


@app.task(bind=True, batch=True, batch_size=5, batch_wait=0.2)
def by_id(self: Any, calls: list[Call]) -> dict[str, Any]:
    """One stream for the whole task; returns a mapping by call id that lacks the
    calls whose doc is negative."""
    assert self.name.endswith("by_id")
    _report("by_id", calls)
    return {c.id: c.kwargs["doc"] + 1 for c in calls if c.kwargs["doc"] >= 0}


@app.task(batch="account", batch_size=4, batch_wait=0.2)
def boom(calls: list[Call]) -> list[int]:
    """Raises when one of its calls asks it to: every call of that batch fails."""
    _report("boom", calls)
    if any(c.kwargs.get("fail") for c in calls):
        raise ValueError(f"boom in a batch of {len(calls)}")
    return [0 for _ in calls]


@app.task(batch="account", batch_size=5, batch_wait=0.2)
def longer_run(calls: list[Call]) -> list[int]:
    """Runs 6 s: the store can restart while it runs."""
    _report("longer_run", calls, sleep=6.0)
    return [c.kwargs["doc"] for c in calls]


@app.task(batch="account", batch_size=5, batch_wait=0.2)
def long_run(calls: list[Call]) -> list[int]:
    """Runs 3 s: a worker can be killed while it runs."""
    _report("long_run", calls, sleep=3.0)
    return [c.kwargs["doc"] for c in calls]


@app.task(batch="account", batch_size=5, batch_wait=0.2, time_limit=1.5)
def overrun(calls: list[Call]) -> list[int]:
    """Runs 6 s against a hard time limit of 1.5 s: its process (greenlet) is killed."""
    _report("overrun", calls, sleep=6.0)
    return [c.kwargs["doc"] for c in calls]


@app.task(batch="account", batch_size=5, batch_wait=0.2, soft_time_limit=1.0)
def overrun_soft(calls: list[Call]) -> list[int]:
    """Runs 6 s against a soft time limit of 1 s: SoftTimeLimitExceeded is raised in it."""
    _report("overrun_soft", calls, sleep=6.0)
    return [c.kwargs["doc"] for c in calls]


@app.task(batch="account", batch_size=5, batch_wait=0.5)
def steady(calls: list[Call]) -> list[int]:
    """Batches of up to 5 calls, 0.5 s after the first, whose body runs 0.8 s: a stream
    of calls keeps some waiting and some batches running at any moment (a failover)."""
    _report("steady", calls, sleep=0.8)
    return [c.kwargs["doc"] * 3 for c in calls]


@app.task
def add_one(value: int) -> int:
    """A plain task after a batched call in a chain."""
    return value + 1


@app.task
def total(values: list[int]) -> int:
    """A chord's callback over batched calls."""
    return sum(values)


@app.task
def double(account: Any, doc: int) -> int:
    """What ``fill`` does for one call, as a plain task (a record Celery writes itself)."""
    return doc * 2


@app.task
def plain_boom(account: Any, fail: bool = False) -> int:
    """What ``boom`` does for one failing call, as a plain task."""
    raise ValueError("boom in a batch of 4")


@app.task
def occupy(seconds: float) -> None:
    """A plain task that keeps one of its worker's processes (thread, greenlet) busy."""
    observer().run("occupy", sleep=seconds)


@app.task
def item_plain(doc: int) -> int:
    """1 ms of work per call, one call per run (a throughput measurement's baseline)."""
    time.sleep(0.001)
    return doc


@app.task(batch=True, batch_size=100, batch_wait=0.05)
def item_batch(calls: list[Call]) -> list[int]:
    """The same 1 ms of work per call, 100 calls per run."""
    time.sleep(0.001 * len(calls))
    return [c.kwargs["doc"] for c in calls]


@app.task(batch="account", batch_size=5, batch_wait=0.2, global_rate_limit="2/s")
def paced_batch(calls: list[Call]) -> list[int]:
    """Batches of up to 5 calls, each batch run one start of a 2/s limit across workers."""
    _report("paced_batch", calls, sleep=0.01)
    return [c.kwargs["doc"] * 2 for c in calls]


@app.task(batch="account", batch_size=5, batch_wait=0.2, global_concurrency=1)
def single_batch(calls: list[Call]) -> list[int]:
    """Batches of up to 5 calls, one batch run at a time across all workers."""
    _report("single_batch", calls, sleep=0.15)
    return [c.kwargs["doc"] * 2 for c in calls]


@app.task(batch="account", batch_size=5, batch_wait=0.2, limits=["partner"], cost=len)
def partner_batch(calls: list[Call]) -> list[int]:
    """Batches of up to 5 calls; a run spends one unit of "partner" per call."""
    _report("partner_batch", calls, sleep=0.01)
    return [c.kwargs["doc"] * 2 for c in calls]


#: The cap two tenants share fairly (``fair_batch``), or first come first served.
FAIR_CAP = 2


@app.task(
    batch=["tenant", "account"],
    batch_size=4,
    batch_wait=0.2,
    global_concurrency=FAIR_CAP,
    fair_key="tenant",
)
def fair_batch(calls: list[Call]) -> list[int]:
    """Batches of up to 4 calls of one tenant's account, 0.1 s each; at most 2 batch runs
    anywhere, shared by tenant (the fair key, read from a batch's first call, is every
    call's: the tenant is in the batch key)."""
    _report("fair_batch", calls, sleep=0.1)
    return [c.kwargs["doc"] for c in calls]


@app.task(batch=["tenant", "account"], batch_size=4, batch_wait=0.2, global_concurrency=FAIR_CAP)
def fifo_batch(calls: list[Call]) -> list[int]:
    """``fair_batch`` without ``fair_key``: first come first served, for comparison."""
    _report("fifo_batch", calls, sleep=0.1)
    return [c.kwargs["doc"] for c in calls]


def _weight(calls: list[Call]) -> int:
    return sum(int(c.kwargs.get("weight", 1)) for c in calls)


@app.task(batch="account", batch_size=5, batch_wait=0.2, limits=["partner"], cost=_weight)
def weighed_batch(calls: list[Call]) -> list[int]:
    """A run spends the calls' weights of "partner": a batch weighing more than its
    burst (5) could never be admitted."""
    _report("weighed_batch", calls, sleep=0.01)
    return [c.kwargs["doc"] * 2 for c in calls]


def _attempt(call: Call) -> int:
    """How many batch runs ``call`` was in so far, this one included (on the observer's
    server: every worker counts in one place)."""
    return int(observer()._redis.incr(f"batching:attempts:{call.id}"))


@app.task(bind=True, batch="account", batch_size=4, batch_wait=0.2, max_retries=2)
def flaky_batch(self: Any, calls: list[Call]) -> list[int]:
    """Retries its whole batch (``self.retry``) while a call asking for it (``fail``:
    how many of its runs fail) has not run that often; then doc * 2 each."""
    attempts = {c.id: _attempt(c) for c in calls}
    _report("flaky_batch", calls, sleep=0.01)
    if any(attempts[c.id] <= c.kwargs.get("fail", 0) for c in calls):
        raise self.retry(countdown=0.3)
    return [c.kwargs["doc"] * 2 for c in calls]


@app.task(
    batch="account",
    batch_size=4,
    batch_wait=0.2,
    max_retries=2,
    autoretry_for=(ValueError,),
    retry_kwargs={"countdown": 0.3},
)
def flaky_auto_batch(calls: list[Call]) -> list[int]:
    """As ``flaky_batch``, retried by ``autoretry_for`` (a ValueError)."""
    attempts = {c.id: _attempt(c) for c in calls}
    _report("flaky_auto_batch", calls, sleep=0.01)
    if any(attempts[c.id] <= c.kwargs.get("fail", 0) for c in calls):
        raise ValueError("not yet")
    return [c.kwargs["doc"] * 2 for c in calls]


def batch_key(task: Task, **kwargs: Any) -> str:
    """A store key of the batch key that a call ``task.delay(**kwargs)`` waits under (its
    hash slot is the whole batch key's)."""
    policy = baton.policy_for(task)
    assert policy is not None and policy.batch is not None
    material = policy.batch.material(task.name, (), kwargs)
    return batch_keys(baton.names, task.name, digest(material))[0]
