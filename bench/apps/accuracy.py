"""Rate-limited no-op tasks for bench/accuracy.py: each records its start time, read
from the clock the moment the task body starts (every worker runs on this machine, so
``time.time()`` is one clock for all of them), then stores it."""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Task

from apps.base import bench_redis, make_app

app = make_app("bench_accuracy")
RATE = int(os.environ.get("BENCH_RATE", "50"))


def record_start(variant: str) -> None:
    started = time.time()  # before the round trip that stores it: no delay of its own
    bench_redis().rpush(f"bench:starts:{variant}", f"{started:.6f}")


@app.task(name="acc_baton", global_rate_limit=f"{RATE}/s")
def acc_baton() -> None:
    record_start("baton")


@app.task(name="acc_celery", rate_limit=f"{RATE}/s")
def acc_celery() -> None:
    record_start("celery")


class SleepLoopLimited(Task):  # type: ignore[misc]
    """The hand-written limiter people start with: in ``__call__``, count starts in
    the current one-second window in Redis and sleep in the pool slot until the
    count is under the limit. (Written for this benchmark; not anyone's code.)"""

    abstract = True
    per_second = RATE
    nap = 0.05

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        client = bench_redis()
        while True:
            window = f"bench:sleeploop:{self.name}:{int(time.time())}"
            pipe = client.pipeline(transaction=False)
            pipe.incr(window)
            pipe.expire(window, 5)
            count = pipe.execute()[0]
            if count <= self.per_second:
                break
            time.sleep(self.nap)
        return super().__call__(*args, **kwargs)


@app.task(name="acc_sleeploop", base=SleepLoopLimited)
def acc_sleeploop() -> None:
    record_start("sleeploop")
