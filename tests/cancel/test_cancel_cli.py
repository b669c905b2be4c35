"""``celery -A proj baton cancel`` (issue 38 §2): by id and by key, then a worker started
after the command never runs the cancelled calls."""

from __future__ import annotations

import json
import time

from celery import states

from tests.ops.test_commands import baton
from tests.support.observer import Observer
from tests.support.workers import Workers

APP = "tests.apps.cancel"


def test_the_cli_cancels_by_id_and_by_key(workers: Workers, observer: Observer) -> None:
    from tests.apps import cancel

    by_id = cancel.keyed.delay(1, 0)
    by_key = [cancel.keyed.delay(2, n) for n in range(3)]
    kept = cancel.keyed.delay(3, 0)
    done = baton(workers, "cancel", by_id.id, "--json", app=APP)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["revoked"] is True
    done = baton(
        workers, "cancel", "--task", cancel.keyed.name, "--key", '{"account_id": 2}', app=APP
    )
    assert done.returncode == 0, done.stderr
    assert "cancelled tests.apps.cancel.keyed" in done.stdout
    bad = baton(workers, "cancel", "--task", cancel.keyed.name, "--key", '{"nope": 2}', app=APP)
    assert bad.returncode != 0 and "nope" in (bad.stderr + bad.stdout)
    typo = baton(
        workers, "cancel", "--task", cancel.keyed.name + "x", "--key", '{"account_id": 9}', app=APP
    )
    assert typo.returncode != 0 and f"did you mean {cancel.keyed.name}" in typo.stderr, typo.stderr

    workers.start(APP, concurrency=1)
    kept.get(timeout=30)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(r.state != states.REVOKED for r in by_key):
        time.sleep(0.1)
    assert by_id.state == states.REVOKED
    assert [r.state for r in by_key] == [states.REVOKED] * 3
    assert {s["task_id"] for s in observer.started()} == {kept.id}
