"""A Celery app with celery-baton installed: global rate and concurrency limits under test.

Run by workers as ``celery -A tests.apps.limits worker``. Reads ``TEST_BROKER_URL``,
``TEST_RESULT_URL``, ``TEST_OBSERVER_URL`` and ``BATON_URL`` (the store under test) from
the environment, and these knobs:

* ``LIMITS_VISIBILITY`` -- the Redis broker's ``visibility_timeout`` in seconds (default
  3600). A test that needs a killed worker's ``acks_late`` messages redelivered sets it
  low; the broker then sweeps for them every second (``unacked_restore_*``).
* ``LIMITS_ACKS_LATE`` (``1``: acks late) and ``LIMITS_PREFETCH`` (default Celery's, 4).
* ``LIMITS_QUEUE`` -- the default queue (default ``celery``): a RabbitMQ test uses a
  queue of its own on the shared server.
* ``LIMITS_HOLD_MAX`` / ``LIMITS_HOLD_HORIZON`` -- ``baton_hold_max`` (default 10000) and
  ``baton_hold_horizon`` (default 300 s).

``app.conf.baton_global_rate_limits`` is on: :func:`celery_rated`'s own Celery
``rate_limit`` is enforced across all workers. Every task reports its run to the
:class:`~tests.support.observer.Observer` (server clock); the observer, not the library,
judges rates and concurrency. A run's start entry carries its pid.

The rate-limited tasks take a distinct ``n`` per call and are also ``exclusive="n"``:
a lease that is always free, but whose fencing token is the store server's ``TIME``
(microseconds) in the very gate call that admitted the run. They report it as the
run's fence, so a test can check the GCRA bound on admission instants exactly, free of
the delay between admission and the task's first line.

In the test process, import it inside a test that uses the ``app_environ`` fixture.
"""

from __future__ import annotations

import os

from celery import Task

from celery_baton import fence
from tests.apps.factory import make_baton_app, observer

VISIBILITY = float(os.environ.get("LIMITS_VISIBILITY", "3600"))
#: The ``lease_ttl`` of the tasks whose slots a SIGKILLed worker keeps.
SHORT_LEASE_TTL = 3.0

app, baton = make_baton_app(
    "limits",
    baton_socket_timeout=1.0,
    baton_global_rate_limits=True,
    baton_hold_max=int(os.environ.get("LIMITS_HOLD_MAX", "10000")),
    baton_hold_horizon=float(os.environ.get("LIMITS_HOLD_HORIZON", "300")),
    task_acks_late=os.environ.get("LIMITS_ACKS_LATE") == "1",
    task_ignore_result=True,
    task_default_queue=os.environ.get("LIMITS_QUEUE", "celery"),
    worker_prefetch_multiplier=int(os.environ.get("LIMITS_PREFETCH", "4")),
    broker_transport_options={
        "visibility_timeout": VISIBILITY,
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
        # kombu's restore scan holds a mutex in the broker for this long (300 s by
        # default); a broker SIGKILLed mid-scan keeps it (AOF) and blocks every restore.
        "unacked_mutex_expire": 5,
    },
    worker_lost_wait=1.0,
    worker_disable_rate_limits=os.environ.get("LIMITS_NO_RATE_LIMITS") == "1",
)


@app.task(bind=True, global_rate_limit="20/s", exclusive="n")
def rated(self: Task, n: int) -> None:
    """20 starts per second across all workers, burst 1."""
    observer().run("rated", fence(), task_id=self.request.id)


@app.task(bind=True, global_rate_limit="1000/s", exclusive="n")
def rated_drain(self: Task, n: int, sleep: float = 0.0) -> None:
    """1000 starts per second: a drain of short tasks on one worker is asked ahead of its
    pool slots (worker/asking_ahead.py), its token spent before the slot frees."""
    observer().run("rated_drain", fence(), sleep=sleep, task_id=self.request.id)


@app.task(bind=True, global_rate_limit="10/s", global_rate_limit_key="tenant", exclusive="n")
def rated_by_tenant(self: Task, tenant: str, n: int) -> None:
    """10 starts per second per tenant, across all workers."""
    observer().run(tenant, fence(), task_id=self.request.id)


@app.task(bind=True, global_rate_limit="10/s", global_rate_limit_burst=5, exclusive="n")
def bursty(self: Task, n: int) -> None:
    """10 starts per second with a burst of 5."""
    observer().run("bursty", fence(), task_id=self.request.id)


@app.task(bind=True, global_rate_limit=["20/s", "30/m"], exclusive="n")
def two_limits(self: Task, n: int) -> None:
    """Two limits in one call: 20/s and 30/m (one start per 2 s binds)."""
    observer().run("two_limits", fence(), task_id=self.request.id)


@app.task(bind=True, global_concurrency=2)
def capped(self: Task, sleep: float) -> None:
    """At most 2 running anywhere."""
    observer().run("capped", sleep=sleep, task_id=self.request.id)


@app.task(bind=True, global_concurrency=2, lease_ttl=SHORT_LEASE_TTL, acks_late=True)
def capped_late(self: Task, key: str, sleep: float) -> None:
    """At most 2 running anywhere; a dead worker's slots come back after 3 s; acks late."""
    observer().run(key, sleep=sleep, task_id=self.request.id)


@app.task(
    bind=True,
    global_concurrency=2,
    global_rate_limit="10/s",
    exclusive="n",
    lease_ttl=SHORT_LEASE_TTL,
)
def limited(self: Task, sleep: float, n: int) -> None:
    """Both limits at once: at most 2 running and 10 starts per second."""
    observer().run("limited", fence(), sleep=sleep, task_id=self.request.id)


@app.task(bind=True, global_rate_limit="1/m")
def crawl(self: Task) -> None:
    """One start per minute: a backlog of these is held by the consumer."""
    observer().run("crawl", task_id=self.request.id)


@app.task(bind=True, rate_limit="1/m")
def celery_crawl(self: Task) -> None:
    """Celery's own ``rate_limit`` of one start per minute, made global."""
    observer().run("celery_crawl", task_id=self.request.id)


@app.task(bind=True, global_rate_limit="12/m")
def paced(self: Task) -> None:
    """One start per 5 s. The run's key says what its message carried when it finally
    ran: ``paced:<retries>:<x_marker header>`` (a hand-back must keep both)."""
    marker = getattr(self.request, "x_marker", None)
    observer().run(f"paced:{self.request.retries}:{marker}", task_id=self.request.id)


@app.task(bind=True, global_rate_limit="4/s")
def trickle(self: Task, n: int) -> None:
    """4 starts per second: a backlog of these is held by the consumers, for seconds."""
    observer().run("trickle", task_id=self.request.id)


@app.task(bind=True)
def free(self: Task) -> None:
    """No limit at all."""
    observer().run("free", task_id=self.request.id)


@app.task(bind=True, rate_limit="10/s", exclusive="n")
def celery_rated(self: Task, n: int) -> None:
    """Celery's own ``rate_limit``, made global by ``baton_global_rate_limits``."""
    observer().run("celery_rated", fence(), task_id=self.request.id)
