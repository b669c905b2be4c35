"""The web view's cancel (issue 38 §2): behind the token, by id and by key; a worker
started after it never runs the cancelled calls."""

from __future__ import annotations

import json
import time
from typing import Any

from celery import states

from tests.ops.web_process import TOKEN
from tests.support.observer import Observer
from tests.support.workers import Workers

APP = "tests.apps.cancel"


def test_the_web_view_cancels_behind_its_token(
    workers: Workers, observer: Observer, web_server: Any
) -> None:
    from tests.apps import cancel

    by_id = cancel.keyed.delay(1, 0)
    by_key = cancel.keyed.delay(2, 0)
    kept = cancel.keyed.delay(3, 0)
    web = web_server(app=APP)
    form = {"action": "cancel", "task_id": by_id.id}
    assert web.post("/api/action", form)[0] == 403
    assert web.post("/api/action", form, token="wrong")[0] == 403
    status, body = web.post("/api/action", form, token=TOKEN)
    assert status == 200 and json.loads(body)["ok"], body
    # Said as the CLI says it: a queued call, not an id nothing is known of.
    assert "it was waiting in the broker" in json.loads(body)["done"], body
    keyed = {"action": "cancel", "task": cancel.keyed.name, "key": '{"account_id": 2}'}
    status, body = web.post("/api/action", keyed, token=TOKEN)
    assert status == 200 and "account_id" in json.loads(body)["done"], body
    bad = {"action": "cancel", "task": cancel.keyed.name, "key": "{nope"}
    status, body = web.post("/api/action", bad, token=TOKEN)
    assert status == 409 and "not JSON" in body, body

    workers.start(APP, concurrency=1)
    kept.get(timeout=30)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and by_key.state != states.REVOKED:
        time.sleep(0.1)
    assert (by_id.state, by_key.state) == (states.REVOKED, states.REVOKED)
    assert {s["task_id"] for s in observer.started()} == {kept.id}
