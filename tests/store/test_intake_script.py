"""The intake script (worker/transport/lua/intake.lua) against a real server: what it
takes from a queue's list, what it records in kombu's unacked index and hash, and a
payload it cannot read left where it was, nothing lost (a script's writes are not undone
when it raises)."""

from __future__ import annotations

import json

import redis

from celery_baton.worker.transport.intake_together import _script_text

QUEUE, INDEX, UNACKED = "celery", "unacked_index", "unacked"


def _payload(tag: str) -> str:
    return json.dumps(
        {
            "body": "e30=",
            "headers": {"id": tag},
            "properties": {
                "delivery_tag": tag,
                "delivery_info": {"exchange": "", "routing_key": "celery"},
            },
        }
    )


def _intake(r: redis.Redis, most: int) -> list[bytes]:
    script = r.register_script(_script_text())
    return list(script(keys=[QUEUE, INDEX, UNACKED], args=[most, "1700000000.5"]))


def test_it_takes_the_oldest_first_and_records_each_unacked_as_kombu_does(
    r: redis.Redis,
) -> None:
    r.delete(QUEUE, INDEX, UNACKED)
    for tag in ("t1", "t2", "t3"):
        r.lpush(QUEUE, _payload(tag))  # kombu's publish: LPUSH; its BRPOP pops the right end
    taken = _intake(r, 2)
    assert [json.loads(p)["properties"]["delivery_tag"] for p in taken] == ["t1", "t2"]
    assert r.llen(QUEUE) == 1
    assert r.zscore(INDEX, "t1") == 1700000000.5
    # kombu's QoS.append keeps [payload, exchange, routing key], the payload unchanged.
    kept = json.loads(r.hget(UNACKED, "t2") or b"")
    assert kept == [json.loads(_payload("t2")), "", "celery"]


def test_a_payload_it_cannot_read_stays_next_in_line_and_nothing_is_lost(
    r: redis.Redis,
) -> None:
    r.delete(QUEUE, INDEX, UNACKED)
    r.lpush(QUEUE, _payload("t1"))
    r.lpush(QUEUE, "not json {")
    r.lpush(QUEUE, json.dumps({"properties": "no delivery tag"}))
    r.lpush(QUEUE, _payload("t4"))
    taken = _intake(r, 10)
    assert [json.loads(p)["properties"]["delivery_tag"] for p in taken] == ["t1"]
    # The unreadable one is back at the end BRPOP pops next, the rest behind it.
    assert r.lrange(QUEUE, 0, -1)[::-1][0] == "not json {"
    assert r.llen(QUEUE) == 3
    assert r.hkeys(UNACKED) == ["t1"]
    r.rpop(QUEUE)  # kombu's BRPOP took it (and dealt with it as it would)
    taken = _intake(r, 10)
    assert taken == []  # the next is unreadable too: back in place, nothing taken
    assert r.llen(QUEUE) == 2
    r.rpop(QUEUE)
    assert [json.loads(p)["properties"]["delivery_tag"] for p in _intake(r, 10)] == ["t4"]
    assert r.llen(QUEUE) == 0
