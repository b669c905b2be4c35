"""A Celery app with celery-baton: one shared cap and one shared rate, fair by tenant.

Run by workers as ``celery -A tests.apps.fair worker``. Reads ``TEST_BROKER_URL``,
``TEST_OBSERVER_URL`` and ``BATON_URL`` from the environment. Every task reports its
run to the :class:`~tests.support.observer.Observer` under its tenant's name (server
clock); the observer, not the library, judges the cap and the share.

* :func:`fair_capped` -- ``global_concurrency=4, fair_key="tenant"``;
* :func:`fair_weighted` -- the same with ``fair_weights={"gold": 3}``;
* :func:`fair_capped_short` -- the same with ``lease_ttl=3``;
* :func:`fifo_capped` -- the same cap without ``fair_key``: the old, first come first
  served behaviour, for comparison;
* :func:`fair_rated` -- ``global_rate_limit="20/s", fair_key="tenant"`` (called with a
  distinct ``n`` each).

In the test process, import it inside a test that uses the ``app_environ`` fixture.
"""

from __future__ import annotations

from celery import Task

from celery_baton import fence
from tests.apps.factory import make_baton_app, observer

CAP = 4
SHORT_LEASE_TTL = 3.0

app, baton = make_baton_app(
    "fair",
    results=False,
    baton_socket_timeout=1.0,
    task_acks_late=False,
    task_ignore_result=True,
    worker_prefetch_multiplier=1,
    # Held requests raise a worker's prefetch (as ETA tasks do): during a store's grace
    # nothing runs, and the first worker told to consume took every one of 420 messages
    # in 0.7 s, the other two none (a CI rehearsal: the cap of 4 never used by one
    # worker's 2 threads). A worker holds at most a third of the tests' backlogs.
    baton_hold_max=150,
)


@app.task(bind=True, global_concurrency=CAP, fair_key="tenant")
def fair_capped(self: Task, tenant: str, sleep: float) -> None:
    """At most 4 running anywhere, shared round-robin by tenant."""
    observer().run(tenant, sleep=sleep, task_id=self.request.id)


@app.task(bind=True, global_concurrency=CAP, fair_key="tenant", fair_weights={"gold": 3})
def fair_weighted(self: Task, tenant: str, sleep: float) -> None:
    """fair_capped where tenant "gold" has weight 3."""
    observer().run(tenant, sleep=sleep, task_id=self.request.id)


@app.task(bind=True, global_concurrency=CAP, fair_key="tenant", lease_ttl=SHORT_LEASE_TTL)
def fair_capped_short(self: Task, tenant: str, sleep: float) -> None:
    """fair_capped whose slots a SIGKILLed worker keeps for 3 s only."""
    observer().run(tenant, sleep=sleep, task_id=self.request.id)


@app.task(bind=True, global_concurrency=CAP)
def fifo_capped(self: Task, tenant: str, sleep: float) -> None:
    """At most 4 running anywhere, first come first served (no fair_key)."""
    observer().run(tenant, sleep=sleep, task_id=self.request.id)


@app.task(bind=True, global_rate_limit="20/s", fair_key="tenant", exclusive="n")
def fair_rated(self: Task, tenant: str, n: int) -> None:
    """20 starts per second across all workers, shared round-robin by tenant. Reports
    its admission instant (the always-free exclusive lease's fence: the store's TIME in
    the admitting call), for an exact rate check (see tests/apps/limits.py)."""
    observer().run(tenant, fence(), task_id=self.request.id)
