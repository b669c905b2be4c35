"""``celery -A proj baton cancel`` (issue 38 §2): by id and by key, then a worker started
after the command never runs the cancelled calls."""

from __future__ import annotations

import json
import time

from celery import states

from tests.ops.test_commands import baton
from tests.support.observer import Observer
from tests.support.waiting import wait_until
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


def _in_broker(workers: Workers, task_id: str) -> object:
    """Where the broker has ``task_id``'s message, read as the command reads it, without
    cancelling it."""
    from celery_baton.worker.transport.queued import queued
    from tests.apps import cancel

    return queued(cancel.app, task_id)


def test_the_cli_says_what_it_found_of_the_call_it_cancelled(
    workers: Workers, observer: Observer
) -> None:
    """A cancel by id is accepted for any id (a call may be published after its cancel),
    and a queued call's result is PENDING like that of an id never published: the
    command says which it was, and of a call that ended, that nothing was stopped."""
    from tests.apps import cancel

    waiting = cancel.keyed.delay(4, 0)  # no worker yet: it waits in the broker
    done = baton(workers, "cancel", waiting.id, "--json", app=APP)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert (found["state"], found["in_broker"], found["revoked"]) == ("PENDING", "queued", True)
    again = baton(workers, "cancel", waiting.id, app=APP)
    assert "revoked or cancelled already" in again.stdout, again.stdout

    mistyped = baton(workers, "cancel", waiting.id[:-4] + "beef", app=APP)
    assert mistyped.returncode == 0, mistyped.stderr
    assert "not in the broker's queues" in mistyped.stdout, mistyped.stdout
    assert "mistyped" in mistyped.stdout

    workers.start(APP, concurrency=1)
    ran = cancel.keyed.delay(5, 0)
    ran.get(timeout=30)
    later = cancel.keyed.apply_async((6, 0), countdown=60)  # the worker holds it, unacked
    wait_until(lambda: _in_broker(workers, later.id) == "delivered", 30, "the worker to take it")
    held = baton(workers, "cancel", later.id, app=APP)
    assert "a worker has it, not acknowledged" in held.stdout, held.stdout
    late = baton(workers, "cancel", ran.id, "--json", app=APP)
    assert json.loads(late.stdout)["state"] == "SUCCESS"
    late = baton(workers, "cancel", ran.id, app=APP)
    assert "already ended (SUCCESS): nothing of it was stopped" in late.stdout, late.stdout
    assert ran.state == states.SUCCESS  # its outcome kept
    assert {s["task_id"] for s in observer.started()} == {ran.id}


def test_a_cancel_by_id_is_made_when_the_broker_is_down(workers: Workers) -> None:
    """Looking for the call in the broker only adds words: a broker that is down is
    tried once (not Celery's 100 connection retries), logged, and the cancel is made."""
    import uuid

    from tests.support.servers import free_port

    down = {"TEST_BROKER_URL": f"redis://127.0.0.1:{free_port()}/0"}
    task_id = str(uuid.uuid4())
    started = time.monotonic()
    done = baton(workers, "cancel", task_id, "--json", app=APP, env=down)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found["cancelled"] == f"task {task_id}" and found["in_broker"] is None
    assert "could not look for" in done.stderr, done.stderr
    assert time.monotonic() - started < 60  # not a minute of retries


def test_on_rabbitmq_the_cli_says_nothing_of_the_broker(
    workers: Workers, rabbitmq_url: str
) -> None:
    """RabbitMQ cannot be read without taking the message: the cancel is made and says
    neither "waiting" nor "not in the broker" (which would be a guess)."""
    import uuid

    task_id = str(uuid.uuid4())
    on_amqp = {"TEST_BROKER_URL": rabbitmq_url}
    done = baton(workers, "cancel", task_id, "--json", app=APP, env=on_amqp)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert (found["state"], found["in_broker"]) == ("PENDING", None)
    said = baton(workers, "cancel", str(uuid.uuid4()), app=APP, env=on_amqp)  # PENDING too
    assert said.returncode == 0, said.stderr
    assert "broker" not in said.stdout, said.stdout
