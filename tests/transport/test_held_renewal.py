"""A held message leaves the worker only when it must (issue 35 §3): on kombu's Redis
transport, a held message's claim on the broker (its score in the unacked index, which
the visibility timeout is counted from) is renewed at the hold horizon instead of the
message going back to its queue. Each hand-back or put-back is a moment where a broker
crash can lose the message (docs/failure.md), and with Redis it comes straight back.

The visibility timeout is 4 s here, so the horizon is 2 s (half of it); three calls of a
1/m task are held for 12 s. The hand-backs per held message are counted, and whether
any message was delivered again (restored by the broker's visibility scan, or handed
back and fetched anew): before, each held message went back at every horizon.
"""

from __future__ import annotations

import re
import time

import redis

from tests.limits.test_rate_limits import APP, publish
from tests.support.observer import Observer
from tests.support.workers import Workers

HELD_FOR_S = 12.0


def test_held_messages_are_renewed_not_handed_back(
    workers: Workers, observer: Observer, broker_url: str
) -> None:
    from tests.apps import limits

    worker = workers.start(APP, concurrency=2, env={"LIMITS_VISIBILITY": "4"})
    publish(limits.crawl, 4)  # 1/m: one runs, three are held
    observer.starts_of("crawl", 1, timeout=30)
    time.sleep(HELD_FOR_S)  # not a wait: the hand-backs are counted over this time

    log = worker.log_text()
    handed_back = log.count("handed back to the broker")
    received = len(re.findall(r"crawl\[[^\]]+\] received", log))
    per_message = handed_back / 3
    assert handed_back == 0, f"{per_message:.1f} hand-backs per held message in {HELD_FOR_S} s"
    assert received == 4, f"{received} deliveries of 4 messages: some came back"
    assert len(observer.started()) == 1
    # The three are still the worker's: unacked, their claim renewed within the timeout.
    with redis.Redis.from_url(broker_url) as r:
        assert r.hlen("unacked") == 3
        now = time.time()
        ages = [now - score for _, score in r.zrange("unacked_index", 0, -1, withscores=True)]
    assert len(ages) == 3 and max(ages) < 4, ages
