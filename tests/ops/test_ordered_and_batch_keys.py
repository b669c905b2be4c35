"""Ordered keys and batch keys in `celery -A app baton locks` and the web view (issues 37
and 38 §1), run as real commands against two real workers: an ordered key with a call
running and three queued, one whose next call has not come (the gap bound's clock), a
batch key with calls waiting and one with a batch running; then none of them once
drained."""

from __future__ import annotations

import html
from typing import Any

import pytest

from tests.ops.test_commands import as_json, baton
from tests.support.observer import Observer
from tests.support.waiting import broadcast, wait_until
from tests.support.workers import Workers

APP = "tests.apps.lines"


def by_kind(entries: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {e["label"]: e for e in entries if e["kind"] == kind}


@pytest.mark.timeout(180)  # ~40 s here: the waits are the bodies' and the bounds'
def test_locks_and_the_web_view_show_ordered_and_batch_keys_until_drained(
    workers: Workers, observer: Observer, web_server: Any
) -> None:
    from tests.apps.lines import (
        BATCH_SIZE,
        BATCH_WAIT,
        GAP,
        app,
        apply_event,
        index_docs,
        slow_index,
    )

    started = [workers.start(APP, concurrency=2, wait=False) for _ in range(2)]
    for worker in started:
        worker.wait_ready()
    hosts = {w.hostname for w in started}
    web = web_server(app=APP)

    # Key "gap": its first call goes to a queue no worker reads; the two after it wait.
    apply_event.apply_async(("gap", 0), queue="nowhere")
    gap_sent = [apply_event.delay("gap", n) for n in (1, 2)]
    # Key "acct": its first call runs until released, the three after it wait their turn.
    first = apply_event.delay("acct", 0, 60.0, "acct")
    rest = [apply_event.delay("acct", n) for n in (1, 2, 3)]
    waiting = [index_docs.delay(account=7, doc=n) for n in range(5)]
    running = [slow_index.delay(account=8, doc=n) for n in range(3)]
    observer.starts_of("apply:acct")
    observer.starts_of("slow_index:8")

    acct, gap = "apply_event(account='acct')", "apply_event(account='gap')"
    docs, slow = "index_docs(account=7)", "slow_index(account=8)"

    def seen() -> bool:
        state = web.state()
        ordered, batches = by_kind(state["ordered"], "ordered"), by_kind(state["batches"], "batch")
        return (
            ordered.get(acct, {}).get("held") == 3
            and ordered.get(gap, {}).get("held") == 2
            and batches.get(docs, {}).get("waiting") == 5
            and len(batches.get(slow, {}).get("runs", [])) == 1
        )

    wait_until(seen, timeout=10, what="both ordered keys and both batch keys seen")
    state = web.state()
    ordered = by_kind(state["ordered"], "ordered")
    line = ordered[acct]
    assert (line["next"], line["last"], line["queued"]) == (1, 4, 3), line
    assert line["running"]["task_id"] == first.id and line["running"]["worker"] in hosts
    assert line["running"]["stale"] is False and line["skip_in"] is None
    line = ordered[gap]
    assert (line["next"], line["queued"], line["running"]) == (1, 2, None), line
    assert 0 < line["skip_in"] <= GAP and line["gap"] == GAP, line
    batches = by_kind(state["batches"], "batch")
    docs_key = batches[docs]
    assert docs_key["runs"] == [] and 0 < docs_key["oldest"] < BATCH_WAIT, docs_key
    assert 0 < docs_key["due_in"] <= BATCH_WAIT and docs_key["size"] == BATCH_SIZE, docs_key
    [run] = batches[slow]["runs"]
    assert run["calls"] == 3 and run["worker"] in hosts and run["ttl_left"] > 0, run
    assert batches[slow]["waiting"] == 0

    page = web.get("/")
    for words in (acct, gap, docs, slow):
        assert html.escape(words) in page, words
    assert first.id in page and "if its call does not come" in page

    # The command line says the same, in the same shapes as leases.
    listing = as_json(workers, "locks", app=APP)
    assert by_kind(listing, "ordered")[acct]["running"]["task_id"] == first.id
    assert by_kind(listing, "batch")[docs]["waiting"] == 5
    text = baton(workers, "locks", app=APP).stdout
    assert all(words in text for words in (acct, gap, docs, slow)), text
    assert "ordered  next 1  queued 3 (3 held in workers)" in text, text
    assert f"running  task {first.id}" in text and "skipped in" in text, text
    assert "batch  5 waiting" in text and "running  batch of 3 calls" in text, text

    # Drained: the first calls end, the missing one is sent where the workers read, the
    # waiting batch fills (every window was long enough to be looked at, however long
    # the commands took to start on a loaded machine; ended here, not waited out).
    observer.release("acct")
    observer.release("slow_index")
    replies = broadcast(app, lambda: app.control.add_consumer("nowhere", reply=True, timeout=10))
    assert len(replies) == 2, replies
    waiting += [index_docs.delay(account=7, doc=n) for n in range(5, BATCH_SIZE)]
    for result in [first, *rest, *gap_sent, *waiting, *running]:
        result.get(timeout=60)
    wait_until(
        lambda: web.state()["ordered"] == [] and web.state()["batches"] == [],
        timeout=20,
        what="the drained keys leave the web view",
    )
    assert "no ordered key has a call running or queued" in web.get("/")
    assert [e for e in as_json(workers, "locks", app=APP) if e["kind"] != "exclusive"] == []
    assert (
        "no live leases, unique claims, ordered keys or batches"
        in baton(workers, "locks", app=APP).stdout
    )
