"""The bookkeeping of worker/transport/broker_writes.py without a broker: which write a
reply answers, what a given-up write leaves, and when a waiting call runs. (The writes
against real brokers and workers: tests/transport/test_broker_writes.py.)"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from celery_baton.worker.transport import broker_writes
from celery_baton.worker.transport.broker_writes import BrokerWrites, unconfirmed


class _Message:
    """What the writes read of kombu's ``Message``: its state and its ``__dict__``."""

    def __init__(self) -> None:
        self._state = "ACK"


class _SentCommands:
    """The wire's side that this bookkeeping uses: what was sent, in order."""

    def __init__(self) -> None:
        self.sent: list[Sequence[Any]] = []

    def send(self, *commands: Sequence[Any]) -> None:
        self.sent.extend(commands)

    def close(self) -> None:
        pass

    def fileno(self) -> int:
        return -1


def _writes() -> tuple[BrokerWrites, _SentCommands]:
    writes = BrokerWrites()
    wire = _SentCommands()
    writes._wire = wire  # type: ignore[assignment]
    writes._loop_thread = threading.get_ident()
    writes._keys = ("unacked_index", "unacked")
    return writes, wire


def _queue(writes: BrokerWrites, kind: str, tag: str, message: Any = None) -> None:
    assert writes._send(kind, tag, message, (("MULTI",), ("EXEC",)))


OK_EXEC = ["OK", "QUEUED", "QUEUED", [1, 1]]


def test_a_call_waits_for_every_write_sent_before_it_and_no_later_one() -> None:
    writes, _ = _writes()
    ran: list[str] = []
    _queue(writes, broker_writes._RECORD, "t1", ("[]", None))
    writes.when_answered(lambda: ran.append("after t1"))
    _queue(writes, broker_writes._ACK, "t1", _Message())
    writes.when_answered(lambda: ran.append("after both"))
    writes._take(OK_EXEC[:3])
    assert ran == []  # a write's answer is its four replies
    writes._take(OK_EXEC[3:])
    assert ran == ["after t1"]
    writes._take(OK_EXEC)
    assert ran == ["after t1", "after both"]
    writes.when_answered(lambda: ran.append("at once"))
    assert ran[-1] == "at once"


def test_an_ack_answered_is_confirmed() -> None:
    writes, _ = _writes()
    message = _Message()
    message.__dict__[broker_writes.UNCONFIRMED_ATTR] = True
    _queue(writes, broker_writes._ACK, "t1", message)
    assert unconfirmed(message)
    writes._take(OK_EXEC)
    assert not unconfirmed(message)
    assert message._state == "ACK"


@pytest.mark.parametrize("exec_reply", [None, ResponseError("EXECABORT")])
def test_an_ack_the_broker_refused_leaves_its_message_unacknowledged(
    exec_reply: Any, caplog: pytest.LogCaptureFixture
) -> None:
    writes, _ = _writes()
    message = _Message()
    message.__dict__[broker_writes.UNCONFIRMED_ATTR] = True
    _queue(writes, broker_writes._ACK, "t1", message)
    with caplog.at_level(logging.ERROR, "celery_baton.worker"):
        writes._take([*OK_EXEC[:3], exec_reply])
    assert message._state == "RECEIVED"  # as a failed kombu ack leaves it
    assert not unconfirmed(message)
    assert "Couldn't ack t1" in caplog.text


def test_a_broken_connection_gives_up_every_write_in_flight_and_runs_the_waiting() -> None:
    writes, _ = _writes()
    ran: list[str] = []
    first, second = _Message(), _Message()
    _queue(writes, broker_writes._ACK, "t1", first)
    _queue(writes, broker_writes._ACK, "t2", second)
    writes.when_answered(lambda: ran.append("waited"))
    writes._broken(str(RedisConnectionError("reset")))
    assert (first._state, second._state) == ("RECEIVED", "RECEIVED")
    assert ran == ["waited"]
    assert writes._wire is None and not writes._pending


def test_the_ack_of_a_message_whose_record_was_given_up_is_sent_again_once_answered() -> None:
    writes, _ = _writes()
    _queue(writes, broker_writes._RECORD, "t1", ("[]", None))
    writes._broken("no reply in 1s")  # the record may still be read by a paused broker
    new_wire = _SentCommands()
    writes._wire = new_wire  # type: ignore[assignment]
    _queue(writes, broker_writes._ACK, "t1", _Message())
    sent_before = len(new_wire.sent)
    writes._take(OK_EXEC)
    again = new_wire.sent[sent_before:]
    assert ("ZREM", "unacked_index", "t1") in again and ("HDEL", "unacked", "t1") in again
    writes._take(OK_EXEC)  # the second ack's answer
    assert not writes._pending and not writes._unrecorded


def test_a_put_back_from_the_record_that_fails_keeps_the_record_for_a_later_try() -> None:
    writes, _ = _writes()
    _queue(writes, broker_writes._RECORD, "t1", ('[{"body": ""}, "", "celery"]', None))
    writes._broken("the broker died")  # the record given up: kept here

    class _Gone:
        def __enter__(self) -> Any:
            raise ConnectionError("the broker is away again")

        def __exit__(self, *exc: Any) -> None:
            return None

    channel = SimpleNamespace(_do_restore_message=print, conn_or_acquire=_Gone)
    qos = SimpleNamespace(channel=channel, _remove_from_indices=print, unacked_key="unacked")
    with pytest.raises(ConnectionError):
        writes.put_back_unrecorded(qos, "t1")
    assert "t1" in writes._unrecorded  # tried again at the next put-back
    assert not writes.put_back_unrecorded(qos, "t2")  # nothing kept of t2: kombu's


def _given_up_record(writes: BrokerWrites, tag: str, delivered: dict[str, Any]) -> None:
    _queue(writes, broker_writes._RECORD, tag, ('[{"body": ""}, "", "celery"]', delivered))
    writes._broken("no reply in 1s")
    writes._wire = _SentCommands()  # type: ignore[assignment]


@pytest.mark.parametrize("way", ["ack", "reject", "ack given up with it"])
def test_a_record_given_up_is_not_sent_again_once_its_message_is_acked_or_rejected(
    way: str,
) -> None:
    """kombu's QoS keeps an acked or rejected tag in ``_delivered`` until its next flush:
    a record sent again then would outlive the ack, and the broker would deliver the
    message again."""
    writes, _ = _writes()
    delivered = {"t1": _Message()}  # still listed, as kombu lists an acked tag
    if way == "ack given up with it":
        _queue(writes, broker_writes._RECORD, "t1", ('[{"body": ""}, "", "celery"]', delivered))
        _queue(writes, broker_writes._ACK, "t1", _Message())
        writes._broken("no reply in 1s")
        writes._wire = _SentCommands()  # type: ignore[assignment]
    else:
        _given_up_record(writes, "t1", delivered)
        if way == "ack":
            dirty: set[str] = set()
            qos = SimpleNamespace(_delivered=delivered, _dirty=dirty, _quick_ack=dirty.add)
            writes.ack(qos, lambda tag: None, "t1")
        else:
            writes._rejecting(lambda tag, requeue=False: None)("t1")
    wire = writes._wire
    sent_before = len(wire.sent)  # type: ignore[union-attr]
    writes._record_again()
    again = wire.sent[sent_before:]  # type: ignore[union-attr]
    assert not [c for c in again if c[0] in ("ZADD", "HSET")], again


def test_a_record_given_up_is_sent_again_while_its_message_is_held() -> None:
    writes, _ = _writes()
    _given_up_record(writes, "t1", {"t1": _Message()})
    wire = writes._wire
    writes._record_again()
    assert ("HSET", "unacked", "t1", '[{"body": ""}, "", "celery"]') in wire.sent  # type: ignore[union-attr]
