"""A Celery app with celery-baton installed whose worker cancels its running
``acks_late`` jobs when it loses the broker
(``worker_cancel_long_running_tasks_on_connection_loss``, off by default in Celery 5,
announced as the default of Celery 6): Celery asks the pool
to stop each job (``Request.cancel``: SIGTERM to a pool process, a greenlet killed; the
threads and solo pools cannot stop one) and the message, unacknowledged, comes back.

Run by workers as ``celery -A tests.apps.conn_loss worker``. Reads ``TEST_BROKER_URL``,
``TEST_RESULT_URL``, ``TEST_OBSERVER_URL`` and ``BATON_URL`` from the environment. In the
test process, import it inside a test that uses the ``app_environ`` fixture.
"""

from __future__ import annotations

import signal
import time
from typing import Any

from celery import Task

from celery_baton import fence
from tests.apps.factory import make_baton_app, observer

app, baton = make_baton_app(
    "conn_loss",
    task_acks_late=True,
    worker_cancel_long_running_tasks_on_connection_loss=True,
    worker_lost_wait=1.0,
    broker_transport_options={"visibility_timeout": 3600},
)


@app.task(bind=True, exclusive="key", exclusive_conflict="wait")
def ex_lingering(self: Task, key: str, seconds: float, linger: float) -> int:
    """One observed run of ``key`` for ``seconds``; stopped by SIGTERM (a pool process),
    it takes ``linger`` more seconds to end (a cleanup), its run still in progress."""
    token = fence()

    def lingering_exit(signum: int, frame: Any) -> None:
        time.sleep(linger)
        raise SystemExit(1)

    if hasattr(signal, "SIGTERM") and _in_own_process():
        signal.signal(signal.SIGTERM, lingering_exit)
    observer().run(key, token, sleep=seconds, task_id=self.request.id)
    return token


def _in_own_process() -> bool:
    """A prefork pool process: the body may take SIGTERM for itself (not in a worker's
    main process, where it is Celery's warm shutdown)."""
    import multiprocessing

    return multiprocessing.current_process().name.startswith("ForkPoolWorker")
