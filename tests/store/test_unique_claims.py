"""Unique claims at publish time against a real server: a give-back undoes a claim that
the store runs after it (issue 11; the 30-minute soak, seed 1102).

A publish whose claim got no answer (the store was paused past the socket timeout)
fails, and its claim is given back in the background; but the paused store still holds
the claim in its input buffer and runs it when it resumes, possibly after the
give-back (which came on another connection). The claim then sat on the key for its
ttl, and the next publish of the key was deduplicated into a message that was never
sent. The give-back now leaves a mark that the late claim finds: it writes nothing.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis

from celery_baton.core.unique import UniqueClaims
from celery_baton.errors import StoreUnavailable
from celery_baton.store import connect
from tests.support.servers import StoreServer
from tests.support.waiting import wait_until

KEY = "baton:{tests.uq}:uq:abc"


@pytest.fixture
def claims(store_url: str) -> Iterator[UniqueClaims]:
    store = connect(store_url)
    store.client.delete(KEY)
    yield UniqueClaims(store)
    store.client.close()


def _claim(claims: UniqueClaims, task_id: str, ttl: float = 60.0) -> str:
    return claims.result(claims.send(KEY, task_id, ttl), KEY, task_id, ttl)


def test_a_claim_run_after_its_give_back_writes_nothing(
    claims: UniqueClaims, r: redis.Redis
) -> None:
    assert claims.give_back(KEY, "lost", 60.0) is False  # the claim was not written yet
    assert _claim(claims, "lost") == ""  # the late claim: its publisher is gone
    assert r.get(KEY) is None, "a claim given back before it ran took the key"
    assert _claim(claims, "next") == "", "deduplicated into a message never sent"
    assert r.get(KEY) == "next"


def test_a_give_back_after_the_claim_frees_it_and_leaves_no_mark(
    claims: UniqueClaims, r: redis.Redis
) -> None:
    assert _claim(claims, "first") == ""
    assert claims.give_back(KEY, "first", 60.0) is True
    assert r.get(KEY) is None
    assert not r.keys("*given-back*")
    assert _claim(claims, "first") == "", "a later publish of the same id claims again"
    assert r.get(KEY) == "first"


def test_a_give_back_of_another_ids_claim_frees_nothing(
    claims: UniqueClaims, r: redis.Redis
) -> None:
    assert _claim(claims, "holder") == ""
    assert claims.give_back(KEY, "lost", 60.0) is False
    assert r.get(KEY) == "holder"
    assert _claim(claims, "other") == "holder"
    assert 55_000 < r.pttl("baton:{tests.uq}:uq-given-back:abc:lost") <= 60_000


def test_a_claim_the_store_runs_after_a_pause_longer_than_its_ttl_is_given_back(
    store_url: str, store_server: StoreServer, r: redis.Redis
) -> None:
    """The 30-minute soak, seed 1104: a publish with ``expires=2`` (claim ttl 2 s) failed
    as the store paused for 8 s; its give-back was retried only until that ttl had
    passed on the publisher's clock, and gave up while the store was still paused. The
    store then ran the buffered claim, whose ttl starts when it runs: the key was held
    by a message never sent, and a publish 1.1 s later was deduplicated into it."""
    ttl = 8.0
    store = connect(store_url, socket_timeout=1)
    claims = UniqueClaims(store)
    store_server.pause()
    try:
        claims.release_later(KEY, "never-sent", ttl)  # what a publish that failed does
        time.sleep(ttl + 2)  # the store answers nothing for longer than the claim's ttl
    finally:
        store_server.resume()
    # The store runs the claim it buffered (its connection's): its ttl starts now.
    late = connect(store_url)
    assert _claim(UniqueClaims(late), "never-sent", ttl) == ""
    took = wait_until(lambda: r.get(KEY) is None, ttl, "the late claim given back")
    assert took < ttl / 2, f"a claim whose message was never sent held the key {took:.1f} s"
    assert _claim(claims, "next") == "", "deduplicated into a message never sent"
    late.client.close()
    store.client.close()


def test_a_claim_the_store_runs_after_its_publisher_gave_up_writes_nothing(
    store_url: str, store_server: StoreServer, r: redis.Redis
) -> None:
    """The 30-minute soak, seed 1106: a publish failed (its claim timed out: the store was
    paused), and the store ran the buffered claim when it resumed; a publish from another
    process in the moment before the give-back landed was deduplicated into the message
    that was never sent. A claim carries the moment its publisher stops waiting (on the
    store's clock): run later, it writes nothing."""
    store = connect(store_url, socket_timeout=1)
    claims = UniqueClaims(store)
    _claim(claims, "warm-up")  # the publisher knows the store's clock
    claims.release(KEY, "warm-up")
    store_server.pause()
    try:
        with pytest.raises(StoreUnavailable):
            _claim(claims, "never-sent")  # gives up after 1 s; give-back in 0.5 s
    finally:
        store_server.resume()  # before the first give-back is sent
    other = connect(store_url)  # another publisher: no give-back of its own to run first
    assert _claim(UniqueClaims(other), "next") == "", "deduplicated into a message never sent"
    assert r.get(KEY) == "next"
    other.client.close()
    store.client.close()
