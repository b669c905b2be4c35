"""A batch's results written together on Celery's Redis result backend
(worker/pool/batch_results.py), against a real server: the records Celery's own
``mark_as_done`` / ``mark_as_failure`` write, in one read and one pipeline."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.app.task import Context

from celery_baton.worker.pool.batch_results import Written, bulk_eligible, store


@pytest.fixture
def app(result_url: str) -> Iterator[Celery]:
    app = Celery("results", backend=result_url, set_as_current=False)
    app.conf.result_extended = True
    yield app
    app.close()


def request(task_id: str, **fields: Any) -> Any:
    return Context(
        {
            "id": task_id,
            "task": "tasks.index",
            "args": (),
            "kwargs": {"doc": 1},
            "hostname": "w1@host",
            "delivery_info": {"routing_key": "celery"},
            **fields,
        }
    )


def raw(app: Celery, task_id: str) -> tuple[dict[str, Any], int]:
    client = app.backend.client
    key = app.backend.get_key_for_task(task_id)
    return json.loads(client.get(key)), int(client.ttl(key))


def same_but_date(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert sorted(a) == sorted(b)
    assert {k: v for k, v in a.items() if k not in ("date_done", "task_id")} == {
        k: v for k, v in b.items() if k not in ("date_done", "task_id")
    }


def test_records_written_together_are_those_celery_writes(app: Celery) -> None:
    backend = app.backend
    backend.mark_as_done("plain-ok", 7, request=request("plain-ok"))
    backend.mark_as_failure(
        "plain-bad", ValueError("no"), traceback="tb", request=request("plain-bad")
    )
    items = [
        Written("bulk-ok", request("bulk-ok"), True, 7),
        Written("bulk-bad", request("bulk-bad"), False, ValueError("no"), "tb"),
    ]
    pubsub = backend.client.pubsub()
    pubsub.subscribe(*(backend.get_key_for_task(i.call_id) for i in items))
    assert store(backend, items) == {"bulk-ok", "bulk-bad"}
    for bulk, plain in (("bulk-ok", "plain-ok"), ("bulk-bad", "plain-bad")):
        (found, ttl), (expected, plain_ttl) = raw(app, bulk), raw(app, plain)
        same_but_date(found, expected)
        assert found["task_id"] == bulk
        assert abs(ttl - plain_ttl) <= 2
    published = []
    for _ in range(20):
        message = pubsub.get_message(timeout=1)
        if message and message["type"] == "message":
            published.append(json.loads(message["data"])["task_id"])
        if len(published) == 2:
            break
    pubsub.close()
    assert sorted(published) == ["bulk-bad", "bulk-ok"]


def test_a_record_that_says_success_is_kept(app: Celery) -> None:
    app.backend.mark_as_done("done-before", 1, request=request("done-before"))
    assert store(app.backend, [Written("done-before", request("done-before"), True, 2)]) == {
        "done-before"
    }
    assert raw(app, "done-before")[0]["result"] == 1


def test_a_result_it_cannot_encode_is_left_to_the_per_call_path(app: Celery) -> None:
    items = [
        Written("fine", request("fine"), True, 1),
        Written("odd", request("odd"), True, object()),
    ]
    assert store(app.backend, items) == {"fine"}


def test_other_backends_keep_the_per_call_path() -> None:
    app = Celery("results", backend="cache+memory://", set_as_current=False)
    assert store(app.backend, [Written("x", request("x"), True, 1)]) == set()


def test_what_celery_writes_more_than_a_record_for_stays_per_call() -> None:
    assert bulk_eligible(Written("a", request("a"), True, 1))
    assert not bulk_eligible(Written("a", request("a", chord={"task": "total"}), True, 1))
    assert not bulk_eligible(Written("a", request("a", ignore_result=True), True, 1))
    assert bulk_eligible(Written("a", request("a", ignore_result=True), False, ValueError()))
    assert bulk_eligible(Written("a", request("a", chain=[{"task": "next"}]), True, 1))
    assert not bulk_eligible(Written("a", request("a", chain=[{"task": "next"}]), False, None))
