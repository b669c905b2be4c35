"""When a stopped run's body has really ended, on each of Celery's pools, and which pools
can stop a run at all.

Celery announces a terminated run (``revoke(terminate=True)``, and every run a
``"replace"`` delivery replaces) as soon as it asked the pool to stop it, while the body
may still run; its key must stay taken until the body has ended. What "ended" means
depends on what the pool's ``terminate_job`` stops:

* prefork (billiard): a signal to the pool process. The request's ``worker_pid`` names
  that process; the run has ended when the process is gone.
* gevent: a ``GreenletExit`` thrown into the greenlet, *asynchronously*: ``terminate_job``
  returns before the body's ``finally`` ran, and the request's ``worker_pid`` is the
  greenlet's ``id()``, which names no process. The run has ended when the greenlet
  is dead (or, sooner, when the pool reports the job's end: the greenlet catches the
  exit and calls the request back after the body unwound).
* eventlet: the same, but ``terminate_job`` waits for the greenthread: the job's end is
  reported before the revoke is announced.
* threads and solo: no ``terminate_job`` (Celery's raises ``NotImplementedError``): a run
  cannot be stopped; it ends when its body returns, and only then is its key free.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from celery_baton.errors import ConfigError

#: The request attribute holding a green pool's greenlet for the run (see ``keep_job``).
GREENLET_ATTR = "_baton_greenlet"


def can_terminate(pool: Any) -> bool:
    """Whether ``pool`` can stop a running job (``revoke(terminate=True)``): it has a
    ``terminate_job`` of its own (gevent, eventlet), or is prefork, which takes billiard's
    when it starts (after the worker's parts are built)."""
    # Imported here: billiard's pool, imported by a publisher, changes what runs at its
    # exit (a pending AsyncResult's __del__ then met a finalized interpreter).
    from celery.concurrency.base import BasePool
    from celery.concurrency.prefork import TaskPool as PreforkPool

    if isinstance(pool, PreforkPool):
        return True
    method = getattr(type(pool), "terminate_job", None)
    return method is not None and method is not BasePool.terminate_job


def keep_job(request: Any, pool: Any, job: Any) -> None:
    """``job``: what ``pool.apply_async`` returned for ``request``. A green pool's is the
    greenlet running the body (gevent's ``Greenlet``, eventlet's ``GreenThread``).

    # assumes: a green pool's apply_async returns the greenlet (tests/pools/test_green.py)
    """
    if getattr(pool, "is_green", False) and hasattr(job, "dead"):
        request.__dict__[GREENLET_ATTR] = job


def run_ended(request: Any) -> tuple[Callable[[], bool], str] | None:
    """How to see that ``request``'s terminated run has ended, and what ran it (for the
    log); None when it ran in this very thread of control (solo), so it has."""
    greenlet = request.__dict__.get(GREENLET_ATTR)
    if greenlet is not None:
        return (lambda: bool(greenlet.dead)), "its greenlet"
    pid = request.worker_pid
    if pid and pid != os.getpid():
        # assumes: a pid names a process (prefork; tests/pools/test_green.py)
        return (lambda: process_gone(pid)), f"its process {pid}"
    return None


def forget_job(request: Any) -> None:
    request.__dict__.pop(GREENLET_ATTR, None)


def process_gone(pid: int) -> bool:
    """Whether process ``pid`` no longer runs code (exited; a zombie counts as gone)."""
    if os.path.isdir("/proc/self"):
        try:
            with open(f"/proc/{pid}/stat") as stat:
                return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X", "x")
        except FileNotFoundError:
            return True
        except (OSError, IndexError):
            pass
    try:  # no /proc (not Linux): ask the kernel (a zombie counts as running until reaped)
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def pool_name(pool: Any) -> str:
    """The name ``celery worker -P`` knows ``pool`` by (threads, solo, ...)."""
    module = type(pool).__module__.rsplit(".", 1)[-1]
    return "threads" if module == "thread" else module


def refuse_unstoppable_replace(pool: Any, replacing: list[str]) -> None:
    """``replacing``: the tasks this worker consumes whose ``exclusive_conflict`` is
    ``"replace"``. A newer publish of such a task stops the running one; a pool that
    cannot stop a run (threads, solo) would let it go on to its end while the newer
    one waits: the promise would not hold, so the worker does not start."""
    if not replacing or pool is None or can_terminate(pool):
        return
    more = f" and {len(replacing) - 1} more" if len(replacing) > 1 else ""
    raise ConfigError(
        f"exclusive_conflict='replace' stops the run it replaces, and the "
        f"{pool_name(pool)} pool cannot stop a running task (task {replacing[0]}{more}): "
        f"run it on a prefork, gevent or eventlet worker, or route it to another queue"
    )
