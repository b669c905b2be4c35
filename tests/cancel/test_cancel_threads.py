"""``baton.cancel`` from short-lived threads (a ``threading.Timer``, a thread per request,
a ``ThreadPoolExecutor`` that shrinks), in the caller's process against the real store:
each thread's store connection goes back to the pool when the thread ends.

The nemesis soak (issue 38, seed 257605182) cancelled from a timer thread per cancel:
after about 100 of them every cancel failed with ``MaxConnectionsError: Too many
connections``, the store untouched: each calling thread had taken a connection of
redis-py's pool (100) for itself and kept it after the thread ended.
"""

from __future__ import annotations

import functools
import threading

import redis


def _in_a_thread(fn: object, *args: object) -> str:
    failed: list[str] = []

    def run() -> None:
        try:
            fn(*args)  # type: ignore[operator]
        except Exception as exc:
            failed.append(repr(exc))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return failed[0] if failed else ""


def test_cancels_from_threads_that_end_do_not_use_up_the_store_connections(
    app_environ: None, store_url: str
) -> None:
    from tests.apps.cancel import baton, keyed

    failed = []
    for i in range(250):
        if i % 5:
            why = _in_a_thread(baton.cancel, f"thread-{i}")
        else:
            by_key = functools.partial(baton.cancel, task=keyed, key={"account_id": 10_000 + i})
            why = _in_a_thread(by_key)
        if why:
            failed.append(f"cancel {i}: {why}")
    assert not failed, f"{len(failed)} of 250 cancels failed, the first: {failed[0]}"
    # And the store sees no more of this process's connections than threads live now.
    clients = redis.Redis.from_url(store_url).client_list()
    assert len(clients) < 60, f"{len(clients)} connections to the store"
