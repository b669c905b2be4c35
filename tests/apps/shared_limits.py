"""A Celery app whose tasks share named limits (``baton_limits``), under test.

Run by workers as ``celery -A tests.apps.shared_limits worker``; reads the same
environment as ``tests.apps.limits`` (``TEST_BROKER_URL``, ``TEST_OBSERVER_URL``,
``BATON_URL``). As there, a rate-limited task also takes an always-free exclusive lease
on a distinct ``n``, whose fence is the store's ``TIME`` in the gate call that admitted
it: the run reports it, and the test checks the shared budget on those instants. A run's
key carries its cost (``"<task>:<cost>"``), for the weighted checker.
"""

from __future__ import annotations

import time

from celery import Task

from celery_baton import fence
from tests.apps.factory import make_baton_app, observer

LIMITS = {
    "api": "10/s",  # a bucket of 10, 10 per second, shared by api_a and api_b
    "tokens": {"rate": "200/s", "burst": 200},  # weighed by each call's tokens
    "pen": "1000/s",  # for penalize
    "gb": {"rate": "1/m", "burst": 3},  # 3 runs, then one a minute: give-back on Cluster
    "slow": {"rate": "5/s", "burst": 2},  # Cluster: tasks' own keys on another slot
}

app, baton = make_baton_app(
    "shared_limits",
    baton_socket_timeout=1.0,
    baton_limits=LIMITS,
    task_ignore_result=True,
)


@app.task(bind=True, limits=["api"], exclusive="n")
def api_a(self: Task, n: int) -> None:
    observer().run("api_a:1", fence(), task_id=self.request.id)


@app.task(bind=True, limits="api", exclusive="n")
def api_b(self: Task, n: int) -> None:
    observer().run("api_b:1", fence(), task_id=self.request.id)


@app.task(bind=True, limits=["tokens"], cost=lambda tokens, n: tokens, exclusive="n")
def complete(self: Task, tokens: int, n: int) -> None:
    """Spends ``tokens`` of the shared 200/s budget."""
    observer().run(f"complete:{tokens}", fence(), task_id=self.request.id)


@app.task(bind=True, limits=["pen"], exclusive="n")
def call_api(self: Task, n: int) -> None:
    observer().run("call_api:1", fence(), task_id=self.request.id)


@app.task(bind=True)
def unlimited(self: Task) -> None:
    observer().run("unlimited:0", task_id=self.request.id)


@app.task(bind=True, limits=["gb"], exclusive="key", exclusive_conflict="wait")
def one_at_a_time(self: Task, key: str, sleep: float) -> None:
    with observer().track(f"{key}:1", task_id=self.request.id):
        time.sleep(sleep)


@app.task(bind=True, exclusive=lambda doc, sleep: doc, exclusive_conflict="wait")
def keyed_by_callable(self: Task, doc: str, sleep: float) -> None:
    """A callable key spec, read from the task as Celery stores it (a class attribute)."""
    with observer().track(doc, task_id=self.request.id):
        time.sleep(sleep)


@app.task(bind=True, limits=["slow"], exclusive="n")
def slow_a(self: Task, n: int) -> None:
    observer().run("slow_a:1", task_id=self.request.id)


@app.task(bind=True, limits=["slow"], exclusive="n")
def slow_b(self: Task, n: int) -> None:
    observer().run("slow_b:1", task_id=self.request.id)
