"""The caller decides (issue 16, seed 004): per-call keys and policies, raise on a
duplicate, wait with a deadline; with real workers and the outside observer."""

from __future__ import annotations

import json
import time

import pytest

from celery_baton import AlreadyQueued, ConfigError, TaskSkipped
from tests.support.observer import Observer, assert_no_overlap
from tests.support.waiting import wait_until
from tests.support.workers import Workers

APP = "tests.apps.per_call"


def test_one_task_under_two_per_call_policies_on_a_shared_key(
    workers: Workers, observer: Observer
) -> None:
    from tests.apps.per_call import job

    workers.start(APP, concurrency=4)
    holder = job.apply_async(("holder", 4.0), baton={"exclusive": "shared"})
    wait_until(lambda: observer.started(), 20, "the holder started")
    skipping = job.apply_async(("skipping",), baton={"exclusive": "shared", "conflict": "skip"})
    waiting = job.apply_async(
        ("waiting",), baton={"exclusive": "shared", "conflict": "wait", "wait_timeout": 60}
    )
    with pytest.raises(TaskSkipped):
        skipping.get(timeout=30)
    assert waiting.get(timeout=60)  # ran, after the holder
    assert holder.get(timeout=30)
    runs = observer.runs()
    assert sorted(r.key for r in runs) == ["holder", "waiting"]
    assert_no_overlap(runs, per_key=False)  # one key: the per-call one


def test_a_per_call_key_and_a_declared_key_naming_the_same_key_exclude_each_other(
    workers: Workers, observer: Observer
) -> None:
    from tests.apps.per_call import feed, job

    workers.start(APP, concurrency=4)
    declared = feed.apply_async(("acme", "declared", 4.0))  # exclusive="tenant"
    wait_until(lambda: observer.started(), 20, "the declared run started")
    # Another tenant's arguments, but the call names tenant "acme" itself:
    same = feed.apply_async(("other", "per-call"), baton={"exclusive": {"tenant": "acme"}})
    with pytest.raises(TaskSkipped):
        same.get(timeout=30)
    # And a task without options, given the same key text, is in its own family: runs.
    assert job.apply_async(("elsewhere",), baton={"exclusive": {"tenant": "acme"}}).get(30)
    assert declared.get(timeout=30)
    assert sorted(r.key for r in observer.runs()) == ["declared", "elsewhere"]


def test_a_wait_deadline_skips_a_duplicate_held_longer(
    workers: Workers, observer: Observer
) -> None:
    from tests.apps.per_call import job

    workers.start(APP, concurrency=4)
    holder = job.apply_async(("holder", 20.0), baton={"exclusive": "long"})
    wait_until(lambda: observer.started(), 20, "the holder started")
    began = time.monotonic()
    late = job.apply_async(
        ("late",), baton={"exclusive": "long", "conflict": "wait", "wait_timeout": 1.5}
    )
    with pytest.raises(TaskSkipped, match="wait_timeout"):
        late.get(timeout=30)
    waited = time.monotonic() - began
    assert waited < 15, f"skipped after {waited:.1f}s, not at its 1.5 s deadline"
    assert [r["key"] for r in observer.started()] == ["holder"]
    holder.revoke(terminate=True)


def test_already_queued_carries_the_first_id_and_nothing_reaches_kwargs(
    workers: Workers, observer: Observer
) -> None:
    from tests.apps.per_call import job, report

    workers.start(APP, concurrency=2)
    first = report.apply_async((7, 2.0))
    with pytest.raises(AlreadyQueued) as error:
        report.apply_async((7,), baton={"unique_conflict": "raise"})
    assert error.value.existing_id == first.id
    assert "uq" in error.value.key
    assert report.apply_async((7,)).id == first.id  # the default still returns the first
    assert first.get(timeout=30)

    received = job.apply_async(("kwargs",), baton={"exclusive": "k", "lease_ttl": 5}).get(30)
    assert json.loads(received) == ["label"]  # no "baton", nothing of ours


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"exclusiv": "k"}, "exclusive"),
        ({"exclusive": "k", "conflict": "queue"}, "conflict must be one of"),
        ({"conflict": "wait"}, "conflict needs exclusive"),
        ({"exclusive": "k", "wait_timeout": -1}, "wait_timeout must be seconds"),
    ],
)
def test_bad_per_call_input_raises_at_publish_and_nothing_is_sent(
    workers: Workers, observer: Observer, options: dict[str, object], match: str
) -> None:
    from tests.apps.per_call import app, job

    with pytest.raises(ConfigError, match=match):
        job.apply_async(("bad",), baton=options)
    with app.connection_for_write() as conn:
        assert conn.default_channel.client.llen("celery") == 0  # nothing was sent


def test_per_call_options_ride_every_publish_path(workers: Workers, observer: Observer) -> None:
    """send_task by name, a signature's .set(), a group member: the same per-call key."""
    from celery import group

    from tests.apps.per_call import app, job

    workers.start(APP, concurrency=4)
    holder = app.send_task(
        "tests.apps.per_call.job", ("by-name", 4.0), baton={"exclusive": "paths"}
    )
    wait_until(lambda: observer.started(), 20, "the holder started")
    signature = job.s("signature").set(baton={"exclusive": "paths"})
    members = group(job.s(f"member-{n}").set(baton={"exclusive": "paths"}) for n in range(2))
    results = [signature.apply_async(), *members.apply_async().results]
    for result in results:
        with pytest.raises(TaskSkipped):
            result.get(timeout=30)
    assert holder.get(timeout=30)
    assert [r.key for r in observer.runs()] == ["by-name"]


def test_under_a_saturated_key_a_higher_priority_is_admitted_first(
    workers: Workers, observer: Observer
) -> None:
    """Requests waiting for one key: a message of a higher priority (on Redis, kombu's
    0 is the highest) that arrives after them is admitted before them (issue 15 §5)."""
    from tests.apps.per_call import job

    worker = workers.start(APP, concurrency=4)
    wait = {"exclusive": "prio", "conflict": "wait"}
    holder = job.apply_async(("holder", 3.0), baton=wait)
    wait_until(lambda: observer.started(), 20, "the holder started")
    low = [job.apply_async((f"low-{n}",), baton=wait, priority=9) for n in range(3)]
    wait_until(
        lambda: all(f"[{r.id}] held for" in worker.log_text() for r in low),
        10,
        "the low ones held in the consumer",
    )
    high = job.apply_async(("high",), baton=wait, priority=0)
    for result in [holder, high, *low]:
        assert result.get(timeout=60)
    order = [r["key"] for r in sorted(observer.started(), key=lambda s: s["start"])]
    assert order[:2] == ["holder", "high"], order
