"""A process forked while another thread held a store connection pool's lock can use
the store (store/connection.py, ``_fresh_pool_locks``).

A worker's main process forks pool processes while its own threads (the lease renewer,
the notice listener) use the store: with ``--max-tasks-per-child`` and ``--autoscale``
it forks them all the time. redis-py's pool resets itself at the child's first call and
takes its lock, inherited as it was at the fork; held then by another thread, the
child hung for ever (a recycled pool under ``global_concurrency`` stalled in a CI
rehearsal: tests/pools/test_bounds.py). Here a thread holds the lock across a real
``fork()``, and the child's first store call must answer.
"""

from __future__ import annotations

import os
import signal
import threading
import time

from celery_baton.store.connection import connect


def test_a_child_forked_while_a_thread_held_the_pool_lock_reaches_the_store(
    store_url: str,
) -> None:
    store = connect(store_url)
    store.ping()  # the pool made a connection: the child's first call resets it
    pool = store.client.connection_pool
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with pool._lock:
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert held.wait(10)
    pid = os.fork()
    if pid == 0:  # the child: one store call, bounded by an alarm
        signal.alarm(10)
        try:
            store.ping()
            os._exit(0)
        except BaseException:
            os._exit(1)
    try:
        deadline = time.monotonic() + 20
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise AssertionError("the forked child hung at its first store call")
            time.sleep(0.05)
    finally:
        release.set()
        holder.join(10)
    assert os.waitstatus_to_exitcode(status) == 0, (
        f"the forked child's first store call ended {os.waitstatus_to_exitcode(status)} "
        "(not 0: it hung until its alarm, or failed)"
    )
