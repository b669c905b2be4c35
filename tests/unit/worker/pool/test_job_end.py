"""Which of Celery's pools can stop a run, and how a stopped run's end is seen."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest
from celery.concurrency import eventlet, gevent, prefork, solo, thread

from celery_baton.errors import ConfigError
from celery_baton.worker.pool.job_end import (
    GREENLET_ATTR,
    can_terminate,
    keep_job,
    pool_name,
    process_gone,
    refuse_unstoppable_replace,
    run_ended,
)


def _pool(module: Any) -> Any:
    return module.TaskPool.__new__(module.TaskPool)  # its class is what is judged


@pytest.mark.parametrize(
    ("module", "name", "stops"),
    [
        (prefork, "prefork", True),
        # gevent's pool has a terminate_job of its own since Celery 5.5 (before: refused).
        (gevent, "gevent", "terminate_job" in vars(gevent.TaskPool)),
        (eventlet, "eventlet", True),
        (thread, "threads", False),
        (solo, "solo", False),
    ],
)
def test_which_pools_can_stop_a_run(module: Any, name: str, stops: bool) -> None:
    pool = _pool(module)
    assert pool_name(pool) == name
    assert can_terminate(pool) is stops
    if stops:
        refuse_unstoppable_replace(pool, ["t.a"])
    else:
        refused = rf"the {name} pool cannot stop .*\(task t.a and 1 more\)"
        with pytest.raises(ConfigError, match=refused):
            refuse_unstoppable_replace(pool, ["t.a", "t.b"])
    refuse_unstoppable_replace(pool, [])  # no "replace" task consumed: nothing to refuse


def test_a_green_run_ends_with_its_greenlet_a_prefork_run_with_its_process() -> None:
    greenlet = SimpleNamespace(dead=False)
    request = SimpleNamespace(worker_pid=id(greenlet))
    keep_job(request, SimpleNamespace(is_green=True), greenlet)
    assert request.__dict__[GREENLET_ATTR] is greenlet
    ended = run_ended(request)
    assert ended is not None and ended[1] == "its greenlet"
    assert not ended[0]()  # the greenlet's id names no process: never read as a pid
    greenlet.dead = True
    assert ended[0]()

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    request = SimpleNamespace(worker_pid=child.pid)
    keep_job(request, SimpleNamespace(is_green=False), object())
    ended = run_ended(request)
    assert ended is not None and ended[1] == f"its process {child.pid}"
    assert not ended[0]()
    child.kill()
    child.wait()
    assert ended[0]() and process_gone(child.pid)

    assert run_ended(SimpleNamespace(worker_pid=os.getpid())) is None  # solo: ran here
