"""Unique tasks: claimed at publish on every path, freed on every outcome.

Issue 2, items 6 and 7 (publish side), and the publish paths of "What a user gets".
Publishes of ``uq_idle`` go to a queue no worker consumes, so "queued" is a state the
test can look at (the broker's list) instead of a race.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import redis
from celery import Celery, chain, group

from celery_baton import Baton, BatonError, KeySpecError, StoreUnavailable
from celery_baton.signals import task_deduplicated
from tests.support.observer import Observer
from tests.support.servers import StoreServer, free_port
from tests.support.waiting import wait_until
from tests.support.workers import Workers

APP = "tests.apps.exclusive"


@pytest.fixture
def store(store_server: StoreServer, store_url: str) -> Iterator[redis.Redis]:
    with store_server.client() as client:
        yield client


@pytest.fixture
def broker(broker_server: StoreServer, broker_url: str) -> Iterator[redis.Redis]:
    with broker_server.client(0) as client:
        yield client


def queued(broker: redis.Redis, queue: str = "idle") -> int:
    """Messages waiting in ``queue`` (all of kombu's priority lists)."""
    return sum(int(broker.llen(name)) for name in broker.keys(f"{queue}*"))


def test_every_publish_path_claims_the_key_and_a_duplicate_queues_nothing(
    store: redis.Redis, broker: redis.Redis
) -> None:
    from tests.apps.exclusive import app, plain, unique_key, uq_idle

    deduplicated: list[dict[str, Any]] = []

    def on_dedup(sender: Any = None, **kw: Any) -> None:
        deduplicated.append(kw)

    task_deduplicated.connect(on_dedup)
    try:
        first = uq_idle.delay("a")
        assert store.get(unique_key(uq_idle, "a")) == first.id
        assert queued(broker) == 1

        # Same key by every path, positional or keyword: the first one's result, no message.
        again = [
            uq_idle.delay("a"),
            uq_idle.delay(key="a"),
            uq_idle.apply_async(("a",)),
            uq_idle.apply_async(kwargs={"key": "a"}, countdown=5),
            app.send_task("tests.apps.exclusive.uq_idle", args=["a"]),
            uq_idle.s("a").apply_async(),
        ]
        assert [result.id for result in again] == [first.id] * len(again)
        assert queued(broker) == 1
        assert [d["existing_id"] for d in deduplicated] == [first.id] * len(again)
        assert len({d["task_id"] for d in deduplicated}) == len(again)

        # Another key is another message; an argument that is not part of the key is ignored.
        other = uq_idle.apply_async(("b",), {"extra": 1})
        assert other.id != first.id
        assert uq_idle.delay("b", extra=2).id == other.id
        assert queued(broker) == 2

        # group: each member claims its own key.
        members = group(uq_idle.s("g1"), uq_idle.s("g2"))()
        ids = [result.id for result in members.results]
        assert store.get(unique_key(uq_idle, "g1")) == ids[0]
        assert store.get(unique_key(uq_idle, "g2")) == ids[1]
        assert queued(broker) == 4
        assert uq_idle.delay("g2").id == ids[1]

        # chain: its first member is published, and claims.
        chained = chain(uq_idle.s("c"), plain.si(1)).apply_async()
        head = chained.parent
        assert head is not None
        assert store.get(unique_key(uq_idle, "c")) == head.id
        assert queued(broker) == 5
        assert uq_idle.delay("c").id == head.id
        assert queued(broker) == 5
    finally:
        task_deduplicated.disconnect(on_dedup)


def test_an_explicit_task_id_is_the_claim_owner(store: redis.Redis, broker: redis.Redis) -> None:
    from tests.apps.exclusive import unique_key, uq_idle

    result = uq_idle.apply_async(("tid",), task_id="my-own-id")
    assert result.id == "my-own-id"
    assert store.get(unique_key(uq_idle, "tid")) == "my-own-id"
    # Re-publishing under the same id (what a retry does) passes and queues it again.
    assert uq_idle.apply_async(("tid",), task_id="my-own-id").id == "my-own-id"
    assert queued(broker) == 2


def test_unique_ttl_bounds_a_claim_and_a_numeric_expires_shortens_it(
    store: redis.Redis, broker: redis.Redis
) -> None:
    from tests.apps.exclusive import unique_key, uq_idle

    uq_idle.delay("ttl")
    assert 3_500_000 < store.pttl(unique_key(uq_idle, "ttl")) <= 3_600_000
    uq_idle.apply_async(("exp",), expires=30)
    assert 0 < store.pttl(unique_key(uq_idle, "exp")) <= 30_000


@pytest.mark.parametrize("form", ["seconds", "aware", "naive-utc", "iso"])
def test_a_publish_after_the_call_expired_in_its_queue_is_a_new_call(
    store: redis.Redis, broker: redis.Redis, form: str
) -> None:
    """``expires`` in every form Celery takes (seconds, a datetime, naive as UTC as the
    worker reads it, an ISO string; django-celery-beat sends a datetime): the call is
    dropped once expired, so its claim lasts no longer. A datetime left the claim its
    whole ``unique_ttl`` (an hour): publishes were deduplicated into a dead call."""
    from tests.apps.exclusive import uq_idle

    at = datetime.now(timezone.utc) + timedelta(seconds=1.5)
    expires = {
        "seconds": 1.5,
        "aware": at,
        "naive-utc": at.replace(tzinfo=None),
        "iso": at.isoformat(),
    }[form]
    first = uq_idle.apply_async((form,), expires=expires)  # no worker reads its queue
    assert uq_idle.apply_async((form,), expires=expires).id == first.id
    time.sleep(2.5)
    assert uq_idle.apply_async((form,)).id != first.id, "deduplicated into an expired call"


@pytest.mark.parametrize("when", ["countdown", "eta"])
def test_a_call_due_after_its_unique_ttl_keeps_its_claim_until_it_is_due(
    store: redis.Redis, broker: redis.Redis, when: str
) -> None:
    """A call published with a ``countdown`` or an ``eta`` waits that long before it can
    run: its claim lasts ``unique_ttl`` from then, not from the publish. Before, a claim
    of 2 s on a call due in 4 s lapsed while the call waited, and a second publish of
    its key was queued beside it."""
    from tests.apps.exclusive import uq_idle_short

    due = {
        "countdown": {"countdown": 4},
        "eta": {"eta": datetime.now(timezone.utc) + timedelta(seconds=4)},
    }[when]
    first = uq_idle_short.apply_async((when,), **due)  # no worker reads its queue
    time.sleep(3)  # past its unique_ttl (2 s), before it is due
    assert uq_idle_short.apply_async((when,)).id == first.id, "a duplicate was queued"


def test_a_key_that_cannot_be_built_fails_the_publish_and_queues_nothing(
    store: redis.Redis, broker: redis.Redis
) -> None:
    from tests.apps.exclusive import app, uq_idle

    for args in [(object(),), (float("nan"),), ({"a": b"bytes"},)]:
        with pytest.raises(KeySpecError, match=r"tests\.apps\.exclusive\.uq_idle\.unique"):
            uq_idle.apply_async(args)
    # Sent by name, Celery does not check the arguments: the key binding does.
    with pytest.raises(KeySpecError, match="do not match"):
        app.send_task("tests.apps.exclusive.uq_idle", args=["k", 1, 2])
    assert queued(broker) == 0
    assert store.keys("*") == []  # nothing claimed, nothing written


def test_a_failed_publish_frees_the_key_it_claimed(store_url: str, store: redis.Redis) -> None:
    """Broker unreachable: the publish raises the broker's error and leaves the key free."""
    port = free_port()
    app = Celery("broken", broker=f"redis://127.0.0.1:{port}/0", set_as_current=False)
    app.conf.update(
        task_publish_retry=False,
        broker_connection_retry=False,
        broker_connection_max_retries=0,
        broker_connection_timeout=1,
    )
    baton = Baton(app, url=store_url)

    @app.task(unique="key", name="broken.unique")
    def unique(key: str) -> None: ...

    key = baton.policy_for(unique).unique_key(baton.names, ("x",), {})
    try:
        for _ in range(2):  # the second publish is not deduplicated against a ghost
            started = time.monotonic()
            with pytest.raises(Exception) as error:
                unique.delay("x")
            assert not isinstance(error.value, BatonError)
            assert isinstance(error.value, OSError | ConnectionError) or "onnect" in repr(
                error.value
            )
            assert time.monotonic() - started < 30
            assert store.get(key) is None
        # The claim was really taken and given back (not skipped): a held key still dedups.
        store.set(key, "holder-id")
        assert unique.delay("x").id == "holder-id"
    finally:
        app.close()
        baton.store.client.close()


def test_a_publish_that_fails_while_the_message_is_built_frees_the_key(
    store_url: str, broker_url: str, store: redis.Redis, broker: redis.Redis
) -> None:
    """The claim is written before Celery builds the message and read just before the
    message is sent; a failure in between (here: a router) gives the claim back."""

    def router(name: str, args: Any, kwargs: Any, options: Any, **kw: Any) -> Any:
        if args and args[0] == "boom":
            raise RuntimeError("router failed")
        return {"queue": "idle"}

    app = Celery("routing", broker=broker_url, set_as_current=False)
    app.conf.task_routes = (router,)
    baton = Baton(app, url=store_url)

    @app.task(unique="key", name="routing.unique")
    def unique(key: str) -> None: ...

    key = baton.policy_for(unique).unique_key(baton.names, ("boom",), {})
    try:
        for _ in range(2):
            with pytest.raises(RuntimeError, match="router failed"):
                unique.delay("boom")
            # A round trip on the publisher's own connection: the store has run
            # everything the publish wrote before the check below reads the key.
            baton.unique.release("baton:{sync}:uq:none", "nobody")
            assert store.get(key) is None
        assert queued(broker) == 0
        first = unique.delay("fine")
        assert unique.delay("fine").id == first.id  # deduplicated by the same path
        assert queued(broker) == 1
    finally:
        app.close()
        baton.store.client.close()


def test_store_down_at_publish_raises_and_claims_nothing(
    store_server: StoreServer, store: redis.Redis, broker: redis.Redis
) -> None:
    from tests.apps.exclusive import plain, unique_key, uq_idle

    store_server.kill()
    try:
        with pytest.raises(StoreUnavailable) as down:
            uq_idle.delay("down")
        assert isinstance(down.value, BatonError)
        assert queued(broker) == 0
        plain.delay()  # tasks without options publish as usual with the store down
    finally:
        store_server.start()
    assert store.get(unique_key(uq_idle, "down")) is None
    result = uq_idle.delay("down")
    assert store.get(unique_key(uq_idle, "down")) == result.id
    assert queued(broker) == 1


def test_store_paused_at_publish_raises_and_leaves_no_claim_behind(
    store_server: StoreServer, store: redis.Redis, broker: redis.Redis
) -> None:
    """A store that stops answering mid-call (SIGSTOP): the publish fails within seconds,
    and once the store answers again no ghost claim blocks the key."""
    from tests.apps.exclusive import baton, unique_key, uq_idle

    baton.store.client.ping()  # connected before the pause
    store_server.pause()
    try:
        started = time.monotonic()
        with pytest.raises(StoreUnavailable):
            uq_idle.delay("paused")
        assert time.monotonic() - started < 30
        assert queued(broker) == 0
    finally:
        store_server.resume()
    # The server runs the claim it had buffered; the publisher gives it back.
    wait_until(
        lambda: store.get(unique_key(uq_idle, "paused")) is None, 10, "ghost claim given back"
    )
    time.sleep(1.5)  # and it stays free
    holder = store.get(unique_key(uq_idle, "paused"))
    assert holder is None, f"a publish that failed left its claim behind, held by {holder}"
    assert uq_idle.delay("paused").id != holder
    assert queued(broker) == 1


# -- with workers ----------------------------------------------------------------------------


def test_unique_until_finished_and_until_started_on_a_worker(
    workers: Workers, observer: Observer, store: redis.Redis
) -> None:
    from tests.apps.exclusive import unique_key, uq, uq_started

    workers.start(APP, concurrency=2)

    # finished: a publish while it runs returns the running one; after it, a new one queues.
    first = uq.delay("fin", 1.5)
    observer.starts_of("fin")
    assert uq.delay("fin", 0).id == first.id
    assert store.get(unique_key(uq, "fin")) == first.id
    assert first.get(timeout=20) == first.id
    # The result is stored by the pool child just before the main process frees the key.
    wait_until(lambda: store.get(unique_key(uq, "fin")) is None, 5, "unique key freed")
    second = uq.delay("fin", 0)
    assert second.id != first.id
    assert second.get(timeout=20) == second.id

    # started: the key is free once the run started, so a publish during the run queues.
    running = uq_started.delay("sta", 1.5)
    observer.starts_of("sta")
    assert store.get(unique_key(uq_started, "sta")) is None
    during = uq_started.delay("sta", 0)
    assert during.id != running.id
    assert during.get(timeout=20) == during.id
    assert running.get(timeout=20) == running.id
    runs = {r.task_id for r in observer.runs() if r.key in ("fin", "sta")}
    assert runs == {first.id, second.id, running.id, during.id}


def test_a_group_with_a_duplicate_member_completes(workers: Workers, observer: Observer) -> None:
    """The duplicate member's pre-assigned id never runs; it gets a final
    TaskDeduplicated state naming the member that runs, so the group never hangs."""
    from celery_baton import TaskDeduplicated
    from tests.apps.exclusive import uq

    workers.start(APP, concurrency=2)
    members = group(uq.s("gdup", 0.5), uq.s("gdup", 0.5))()
    outcomes = members.get(timeout=10, propagate=False)
    ran = [o for o in outcomes if isinstance(o, str)]
    deduplicated = [o for o in outcomes if isinstance(o, Exception)]
    assert len(ran) == 1 and len(deduplicated) == 1, outcomes
    assert isinstance(deduplicated[0], TaskDeduplicated), deduplicated
    assert ran[0] in str(deduplicated[0])
    assert [r.task_id for r in observer.runs()] == ran


def test_a_chain_whose_head_is_deduplicated_ends_with_a_clear_state(
    workers: Workers, observer: Observer
) -> None:
    """A chain whose head is a duplicate is not queued (documented): every frozen id of
    the chain gets TaskDeduplicated, so waiting on the chain ends instead of hanging."""
    from celery_baton import TaskDeduplicated
    from tests.apps.exclusive import plain, uq

    workers.start(APP, concurrency=2)
    holder = uq.delay("chead", 1.0)
    chained = chain(uq.s("chead", 0), plain.si("tail")).apply_async()
    with pytest.raises(TaskDeduplicated, match=holder.id):
        chained.get(timeout=10)
    assert holder.get(timeout=10) == holder.id
    assert [r.key for r in observer.runs()] == ["chead"]
