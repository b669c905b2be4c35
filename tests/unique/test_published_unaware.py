"""A ``unique`` task published by a process that does not know its options: sent by
name from an app without the task's code (a web service sending to a worker service),
or by a publisher without celery-baton. Its options are the worker's; the publisher
cannot claim a key it does not know. The worker claims it when the call arrives
there: a duplicate reaching a worker while an earlier call of the key is queued in a
worker or running is not run (a ``TaskDeduplicated`` failure names the one that runs);
its message was queued all the same, which the worker says once per task, naming the
cause and the remedy (before, the duplicates ran, silently).

Judged by the worker's log, the observer's starts and the results: no word for calls
its own app published, the warning for each of the two kinds of publisher.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.celery_processes import REPO_ROOT, _process_env
from tests.support.machine import Machine
from tests.support.observer import Observer
from tests.support.pools import POOLS_AND_RECYCLED, pool_setting
from tests.support.waiting import wait_until
from tests.support.workers import Workers

APP = "tests.apps.exclusive"
SAID = "was published by a process that does not know its options"


def _said(log: str) -> list[str]:
    """The tasks the warning named, in order."""
    return re.findall(rf"(\S+)\[[0-9a-f-]+\] {SAID}", log)


def _succeeded(log: str, name: str) -> int:
    return len(re.findall(rf"Task {re.escape(name)}\[[0-9a-f-]+\] succeeded", log))


#: A publisher in its own process that never imports the task's module: with
#: celery-baton installed, or without it. (In the test's own process every app would
#: know the task: Celery adds a module's tasks to every app it finalizes.)
PUBLISHERS = {
    "by-name": (
        "import os; from celery import Celery; from celery_baton import Baton; "
        "app = Celery('web', broker=os.environ['TEST_BROKER_URL']); "
        "Baton(app, url=os.environ['BATON_URL']); "
        "print(app.send_task({name!r}, args={args!r}).id)"
    ),
    "no-baton": (
        "import os; from celery import Celery; "
        "app = Celery('legacy', broker=os.environ['TEST_BROKER_URL']); "
        "print(app.send_task({name!r}, args={args!r}).id)"
    ),
}


def _publish(workers: Workers, publisher: str, name: str, *args: object) -> str:
    """The task id of one call published by ``publisher`` in a process of its own."""
    code = PUBLISHERS[publisher].format(name=name, args=args)
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=_process_env(workers.env),
        cwd=REPO_ROOT,
        check=True,
        timeout=60,
        capture_output=True,
        text=True,
    )
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.timeout(120)
def test_a_unique_task_published_where_its_options_are_unknown_is_said(
    workers: Workers,
) -> None:
    from tests.apps.exclusive import uq, uq_started

    worker = workers.start(APP, concurrency=2)
    assert uq.delay("known").get(timeout=30)
    assert uq_started.delay("known").get(timeout=30)
    _publish(workers, "by-name", uq.name, "by-name")
    _publish(workers, "no-baton", uq_started.name, "no-baton")
    _publish(workers, "by-name", uq.name, "by-name-again")  # said once per task
    wait_until(
        lambda: (
            _succeeded(worker.log_text(), uq.name) == 3
            and _succeeded(worker.log_text(), uq_started.name) == 2
        ),
        30,
        "every call to run",
    )
    assert _said(worker.log_text()) == [uq.name, uq_started.name]


#: How long the call that runs lasts: the test publishes beside it while it runs.
RUN_S = 8.0


@pytest.mark.timeout(180)
@pytest.mark.parametrize("pool", POOLS_AND_RECYCLED)
def test_duplicates_published_where_its_options_are_unknown_run_once(
    pool: str, workers: Workers, observer: Observer, tmp_path: Path
) -> None:
    """Five calls of one key, by name from a service without the task and from a
    publisher without celery-baton, queued before two workers (two machines) start: one
    runs; each other one is a ``TaskDeduplicated`` failure naming it. A call of the key
    published by the task's own app while that run lasts is not queued (its claim);
    once the run ended, the key is free: a new call by name runs (its run's end frees
    it, on every pool)."""
    from tests.apps.exclusive import app, uq

    ids = [_publish(workers, "by-name", uq.name, "dup", RUN_S) for _ in range(3)]
    ids += [_publish(workers, "no-baton", uq.name, "dup", RUN_S) for _ in range(2)]
    name, extra, env = pool_setting(pool)
    for machine_name in "ab":
        machine = Machine(tmp_path / machine_name)
        workers.start(
            APP,
            pool=name,
            extra_args=extra,
            env={**env, **machine.env},
            cwd=machine.cwd,
            concurrency=2,
        )
    observer.starts_of("dup", 1, timeout=60)
    aware = uq.delay("dup", RUN_S)
    assert not [r for r in observer.runs() if r.key == "dup"], "the run ended before the publish"
    results = [app.AsyncResult(task_id) for task_id in ids]
    wait_until(lambda: all(r.ready() for r in results), 60, "every call to be settled")
    ran = [s["task_id"] for s in observer.started() if s["key"] == "dup"]
    assert len(ran) == 1, f"{len(ran)} calls of one unique key ran: {ran}"
    assert aware.id == ran[0], "the call the app published was queued beside the run"
    for result in results:
        if result.id == ran[0]:
            assert result.state == "SUCCESS"
            continue
        assert result.state == "FAILURE", (result.id, result.state)
        assert type(result.result).__name__ == "TaskDeduplicated", repr(result.result)
        assert ran[0] in str(result.result), str(result.result)
    again = app.AsyncResult(_publish(workers, "by-name", uq.name, "dup", 0.0))
    assert again.get(timeout=30) == again.id
    assert len([s for s in observer.started() if s["key"] == "dup"]) == 2
