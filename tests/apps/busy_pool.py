"""A Celery app whose pools are kept busy by plain work while limited tasks wait.

The deployment profile of issue 24 §1: Celery's defaults (prefetch 4 unless the test
passes ``--prefetch-multiplier``), the pool the test chooses, and plain tasks
(:func:`occupy`) holding the pool's processes while limited tasks arrive. Each limited
task reports its start to the :class:`~tests.support.observer.Observer` (its own
server's clock) under its kind's name, so a test judges every limit where the user
meets it: at the task body's start.

Reads ``TEST_BROKER_URL``, ``TEST_OBSERVER_URL`` and ``BATON_URL``.

In the test process, import it inside a test that uses the ``app_environ`` fixture.
"""

from __future__ import annotations

import os

from celery import Task

from tests.apps.factory import make_baton_app, observer

#: Every kind's rate: 2 starts a second (burst 1), so a burst is plain to see.
RATE = "2/s"
#: The named limit: 4 units a second with a bucket of 2, each call costing 2 units,
#: i.e. 2 starts a second and 1 back to back.
NAMED = {"rate": "4/s", "burst": 2}
NAMED_COST = 2

app, baton = make_baton_app(
    "busy_pool",
    results=False,
    baton_limits={"api": NAMED},
    task_ignore_result=True,
    # TEST_DISABLE_RATE_LIMITS=1: Celery's own rate limits off in the worker (a setting
    # deployments use): the global limits are celery-baton's, and must hold all the same.
    worker_disable_rate_limits=os.environ.get("TEST_DISABLE_RATE_LIMITS") == "1",
    # TEST_PREFETCH_MULTIPLIER=0: no prefetch limit (`--prefetch-multiplier 0` reads as
    # "not given" on Celery's command line, so only the setting says it).
    worker_prefetch_multiplier=int(os.environ.get("TEST_PREFETCH_MULTIPLIER", "4")),
)


@app.task(bind=True)
def occupy(self: Task, sleep: float) -> None:
    """Plain work that keeps one pool process busy for ``sleep`` seconds."""
    observer().run("occupy", sleep=sleep, task_id=self.request.id)


@app.task(bind=True, global_rate_limit=RATE)
def rated(self: Task, n: int) -> None:
    """One rate: 2/s across all workers."""
    observer().run("rated", task_id=self.request.id)


#: The throttle's window (s): at most one start in it.
THROTTLE = 2.0


@app.task(bind=True, throttle=THROTTLE, throttle_mode="trailing")
def throttled(self: Task, n: int) -> None:
    """A throttle: one start per window, the newest of the others after it."""
    observer().run("throttled", task_id=self.request.id)


@app.task(bind=True, global_rate_limit=[RATE, "600/m"])
def two_rates(self: Task, n: int) -> None:
    """Two rates in one call; 2/s binds."""
    observer().run("two_rates", task_id=self.request.id)


@app.task(bind=True, limits=["api"], cost=lambda n: NAMED_COST)
def named(self: Task, n: int) -> None:
    """A named limit with a cost of 2 units per call: 2 starts a second."""
    observer().run("named", task_id=self.request.id)


@app.task(bind=True, global_rate_limit=RATE, global_rate_limit_key="tenant")
def per_key(self: Task, tenant: str, n: int) -> None:
    """2/s per tenant."""
    observer().run(f"per_key:{tenant}", task_id=self.request.id)


@app.task(bind=True, global_rate_limit=RATE, fair_key="tenant")
def fair(self: Task, tenant: str, n: int) -> None:
    """2/s in all, shared round-robin by tenant."""
    observer().run(f"fair:{tenant}", task_id=self.request.id)


@app.task(bind=True, global_concurrency=1)
def capped(self: Task, sleep: float) -> None:
    """At most one running anywhere."""
    observer().run("capped", sleep=sleep, task_id=self.request.id)


@app.task(bind=True, exclusive=True, exclusive_conflict="wait")
def one_at_a_time(self: Task, sleep: float) -> None:
    """One run at a time (all calls share one key); duplicates wait."""
    observer().run("one_at_a_time", sleep=sleep, task_id=self.request.id)
