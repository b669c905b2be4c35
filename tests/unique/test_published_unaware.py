"""A ``unique`` task published by a process that does not know its options: sent by
name from an app without the task's code (a web service sending to a worker service),
or by a publisher without celery-baton. Its options are the worker's; the publisher
cannot claim a key it does not know, so the call is not deduplicated. That loss was
silent: the worker now says it, once per task, naming the cause and the remedy.

Judged by the worker's log: no word for calls its own app published, the warning for
each of the two kinds of publisher.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.support.celery_processes import REPO_ROOT, _process_env
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
        "app.send_task({name!r}, args=({key!r},))"
    ),
    "no-baton": (
        "import os; from celery import Celery; "
        "app = Celery('legacy', broker=os.environ['TEST_BROKER_URL']); "
        "app.send_task({name!r}, args=({key!r},))"
    ),
}


def _publish(workers: Workers, publisher: str, name: str, key: str) -> None:
    code = PUBLISHERS[publisher].format(name=name, key=key)
    subprocess.run(
        [sys.executable, "-c", code],
        env=_process_env(workers.env),
        cwd=REPO_ROOT,
        check=True,
        timeout=60,
    )


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
